"""`ft=torchft` with sharded replica groups (HSDP-style): per machine a torchrun whose ranks
shard the model with FSDP2 (`dist.shard_size` = the ranks per machine), torchft averaging each
shard across the machines (rank r of every group holds shard r), and a restarted group healing
each rank's local shards from the live group's same rank."""

from __future__ import annotations

import json

import pytest

from tests.helpers import FAST, survivors, tagged_env, torchrun_machine

pytest.importorskip("torchft")

ARGS = FAST + [
    "data.num_samples=900",
    "trainer.batch_size=16",
    "trainer.log_every=2",
    "trainer.eval_every=1000",
    "trainer.checkpoint_every=0",
    "sync.warmup_steps=4",
    "sync.period=4",
    "logger=jsonl",
    "ft=torchft",
    "ft.replica_groups=2",
    "ft.timeout_s=10",
    "sync.check_replicas=true",
    "dist.world_size=null",
    "dist.shard_size=2",
]


def _participants(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    seq = [r["participants"] for r in map(json.loads, lines) if "participants" in r]
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


def _launch(tmp_path, extra: list[str], run_dir=None) -> tuple[list[int], list[str]]:
    """A lighthouse and two `torchrun --nproc-per-node=2` (groups 0 and 1) on loopback; their
    exit codes and outputs, after asserting they leave no process behind. `run_dir`: one run
    directory for both (a shared filesystem), else `group_0` and `group_1` under `tmp_path`."""
    from localsgd.averaging.torchft import start_lighthouse

    server, address = start_lighthouse(1, heartbeat_timeout_ms=1000, quorum_tick_ms=20)
    env, tag = tagged_env({"RUST_LOG": "warn"})
    groups = []
    try:
        for index in range(2):
            args = (
                ARGS
                + extra
                + [
                    f"ft.lighthouse={address.removeprefix('http://')}",
                    f"ft.replica_id=group_{index}",
                    f"hydra.run.dir={run_dir or tmp_path / f'group_{index}'}",
                ]
            )
            groups.append(torchrun_machine(args, env))
        outputs = [g.communicate(timeout=200)[0] for g in groups]
    finally:
        for g in groups:
            g.kill()
        server.shutdown()
    assert not survivors(tag)
    return [g.returncode for g in groups], outputs


def _two_machines(tmp_path, extra: list[str], run_dir=None) -> list[str]:
    """`_launch`, asserting both torchruns exit 0; their outputs."""
    codes, outputs = _launch(tmp_path, extra, run_dir)
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "strategy",
    [
        # local SGD, SGD with momentum: one state tensor per shard (~30 s: `make test-long`;
        # test_a_heal_carries_each_ranks_local_shards_and_the_next_step_matches runs the heal
        # of each rank's shards in `make test`)
        pytest.param([], marks=pytest.mark.long),
        # DiLoCo: AdamW's two moments per shard and its step count, the outer momentum
        # (~20 s more: `make test-long`; the heal round trip below covers AdamW's state)
        pytest.param(
            ["sync.outer=diloco", "optim=adamw", "optim.lr=0.003"], marks=pytest.mark.long
        ),
    ],
    ids=["local-sgd", "diloco"],
)
def test_a_sharded_group_killed_and_restarted_heals_each_shard_from_the_live_group(
    strategy, tmp_path
):
    """Rank 2 (group 1's first) is SIGKILLed at step 10; torchrun restarts group 1, whose two
    ranks each take their own shard of the model and optimizer state from group 0's rank of the
    same index, and train on: participants 2 -> 1 -> 2, one heal, every sync's shards checked
    bit-identical across the groups; checkpoints every 40 steps, written by group 0."""
    once, back = tmp_path / "killed-once", tmp_path / "group-1-back"
    # group 0 waits at step 20 until torchrun has restarted group 1 (the restarted processes
    # write `back` before their first round), so it cannot finish first, however slow the
    # restart (a slow simulated link kept it training before: under load, not long enough)
    fault = "{_target_:tests.faults.Fault,spec:'%s'}"
    callbacks = [fault % f"kill:2:10:{once}", fault % f"wait:0:20:{back}",
                 fault % f"wait:1:20:{back}",
                 f"{{_target_:tests.faults.Arrival,after:'{once}',marks:'{back}'}}"]  # fmt: skip
    outputs = _two_machines(
        tmp_path,
        [
            *strategy,
            "trainer.max_steps=120",
            "trainer.checkpoint_every=40",
            f"trainer.callbacks=[{','.join(callbacks)}]",
        ],
    )
    for rank in (2, 3):  # both shards of group 1
        assert f"ft: worker {rank} healed from a live peer" in outputs[1], outputs[1][-3000:]
    run_dir = tmp_path / "group_0"  # global rank 0 writes the results
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["shard_size"] == 2
    assert summary["steps"] == 120 and summary["heals"] == 1
    assert summary["participants"] == 2 and summary["participants_min"] == 1
    assert summary["replica_checks"] > 0
    assert _participants(run_dir) == [2, 1, 2]
    # the drift, each rank's distance summed over its shards, then across the groups through
    # the Manager: 0 while group 0 averages alone, positive once both do again
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    drifts = [r["drift"] for r in map(json.loads, lines) if "drift" in r]
    assert len(drifts) > 20 and all(d >= 0 for d in drifts) and drifts[-1] > 0, drifts
    assert not (tmp_path / "group_1" / "summary.json").exists()
    # the checkpoints (the first round at or after 40 and 80, and the end) are the leading
    # group's, written by its 2 ranks into its own run directory
    from localsgd.loop import checkpoint

    steps = checkpoint.listed_steps(str(run_dir))
    assert len(steps) == 2 and steps[0] == 120, steps
    for step in steps:
        assert _shared_marker(run_dir, step)["group"] == 0
    assert not checkpoint.listed_steps(str(tmp_path / "group_1"))


# Checkpoints every 8 steps, plain SGD without momentum and no dropout: a shared checkpoint
# (the leading group's state) then holds everything every group needs, so a resume is exact.
CHECKPOINTED = ["trainer.max_steps=32", "trainer.checkpoint_every=8", "optim.momentum=0"]


def _sigterm_both(once) -> str:
    """SIGTERM to both machines' torchruns (as a scheduler stopping the job), from group 0's
    rank 0 and group 1's rank 0 (global rank 2) at step 13, once."""
    faults_ = [f"{{_target_:tests.faults.Fault,spec:'sigterm:{r}:13:{once}-{r}'}}" for r in (0, 2)]
    return f"trainer.callbacks=[{','.join(faults_)}]"


def _shared_marker(run_dir, step: int) -> dict:
    from localsgd.loop import checkpoint

    marker = checkpoint.verify(checkpoint.step_dir(str(run_dir), step))
    assert marker["shared"] and marker["shard_size"] == 2 and marker["world_size"] == 4, marker
    assert list(marker["files"]) == ["rank-0.pt", "rank-1.pt"], marker  # the group's 2 ranks
    assert "dcp/.metadata" in marker["dcp_files"], marker
    return marker


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_sharded_ft_job_checkpoints_from_its_leading_group_and_resumes_after_sigterm(tmp_path):
    """Two torchruns of 2 ranks sharing one run directory. Every checkpoint (after steps 9,
    17, 25, 32; the last two kept) is one shared state written complete by group 0, the
    leading group, its two ranks together through DCP. SIGTERM to both machines at step 13:
    every rank stops after the same round (step 17) with that checkpoint; the same command
    resumes both groups from it (each rank loading the leading group's shard of its index) and
    ends bit-identical to the uninterrupted job."""
    from localsgd.loop import checkpoint
    from tests.helpers import same_model

    reference = tmp_path / "reference"
    _two_machines(tmp_path, CHECKPOINTED, reference)
    # syncs after steps 5, 9, 13, ...: the first round at or after each multiple of 8, and
    # the end (keep_checkpoints=2)
    assert checkpoint.listed_steps(str(reference)) == [32, 25]
    for step in (32, 25):
        assert _shared_marker(reference, step)["group"] == 0

    run_dir = tmp_path / "run"
    args = CHECKPOINTED + [_sigterm_both(tmp_path / "once")]
    codes, outputs = _launch(tmp_path, args, run_dir)
    assert 0 not in codes, "\n".join(o[-3000:] for o in outputs)
    assert "SIGTERM: stopped after step 17 with a checkpoint" in outputs[0], outputs[0][-3000:]
    assert checkpoint.listed_steps(str(run_dir)) == [17, 9]
    assert _shared_marker(run_dir, 17)["group"] == 0
    assert not (run_dir / "summary.json").exists()

    outputs = _two_machines(tmp_path, args, run_dir)  # the same command, once more
    for out in outputs:  # each torchrun found it
        assert f"resuming from {checkpoint.step_dir(str(run_dir), 17)}" in out, out[-3000:]
        assert "resuming every replica group from one group's shared checkpoint" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 32 and summary["shard_size"] == 2
    assert same_model(run_dir / "model.pt", reference / "model.pt")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "extra, ranks, line",
    [
        ([], 2, None),  # shard_size = the ranks per machine: built
        ([], 4, "dist.shard_size must equal the ranks per machine (4, torchrun's"),
        (["trainer.checkpoint_every=10"], 2, None),  # written by the leading group (below)
    ],
)
def test_under_torchrun_shard_size_is_the_ranks_per_machine(extra, ranks, line, monkeypatch):
    from localsgd.cli.checks import _get
    from localsgd.cli.sharding import validate_sharding
    from localsgd.config import ConfigError
    from tests.helpers import compose_config

    for key, value in (("RANK", "0"), ("WORLD_SIZE", str(ranks)), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    cfg = compose_config(["ft=torchft", "dist.shard_size=2", "trainer.checkpoint_every=0", *extra])
    if line is None:
        validate_sharding(cfg, _get, ranks)
        return
    with pytest.raises(ConfigError) as refused:
        validate_sharding(cfg, _get, ranks)
    assert line in str(refused.value) and "\n" not in str(refused.value), refused.value


def _heal_round_trip(rank: int, world: int) -> dict:
    """One replica group of `world` ranks: rank r's heal state of a trained sharded model and its
    AdamW, carried as torchft's transport does (torch.save), loaded into a fresh model and an
    optimizer that has taken no step (a restarted rank's); then one more step on both."""
    import io

    import torch
    from torch import nn

    from localsgd.averaging.flat import local_tensor
    from localsgd.loop.checkpoint import ModuleState
    from localsgd.loop.fault_tolerance import _heal_loader, _heal_state
    from localsgd.loop.fsdp import Sharding

    torch.set_num_threads(1)
    sharding = Sharding(world, world, torch.device("cpu"))

    def build(seed: int):
        torch.manual_seed(seed)
        model = sharding.shard(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(model, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    peer, peer_opt = build(0)
    for s in range(2):
        step(peer, peer_opt, s)
    healer, healer_opt = build(1)
    for component, target in ((ModuleState(peer), healer), (peer_opt, healer_opt)):
        own = ModuleState(target) if isinstance(target, nn.Module) else target
        wire = io.BytesIO()
        torch.save(_heal_state(component)(), wire)
        wire.seek(0)
        _heal_loader("x", own)(torch.load(wire, weights_only=False))

    def shards(model, opt) -> list:
        state = [local_tensor(p).clone() for p in model.parameters()]
        for p in model.parameters():
            state += [local_tensor(v).clone() for v in opt.state[p].values()]
        return state

    def same() -> bool:
        pairs = zip(shards(peer, peer_opt), shards(healer, healer_opt), strict=True)
        return all(torch.equal(a, b) for a, b in pairs)

    healed = same()
    step(peer, peer_opt, 2)
    step(healer, healer_opt, 2)
    after = same()
    return {"healed": healed, "after": after, "n": len(shards(peer, peer_opt))}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_heal_carries_each_ranks_local_shards_and_the_next_step_matches():
    from tests.helpers import run_distributed

    results = run_distributed(_heal_round_trip, 2, timeout_s=60)
    for r in results:
        # 4 parameters, each with AdamW's step, exp_avg and exp_avg_sq
        assert r == {"healed": True, "after": True, "n": 16}, results

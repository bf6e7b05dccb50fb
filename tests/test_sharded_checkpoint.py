"""Checkpoints of sharded runs (`dist.shard_size` > 1, localsgd/loop/checkpoint/): one DCP
save of every replica group's model and optimizer, the rest per rank, complete once marked.

The job: 4 processes as 2 replica groups of 2, DiLoCo (period 5: outer steps after steps 0, 5,
10, 15, 20), AdamW, dropout (the per-rank RNG matters), 24 steps, checkpoints after steps 8
(2 local steps after a sync), 16 (at a sync) and 24.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from localsgd.loop import checkpoint
from localsgd.loop.checkpoint.relayout import relayout
from localsgd.loop.checkpoint.reshard import resume_line
from tests.helpers import cli, refusal, same_model

JOB = [
    "data=synthetic",
    "data.num_samples=600",
    "model=mlp",
    "model.hidden=[16]",
    "model.dropout=0.1",
    "trainer.batch_size=8",
    "trainer.max_steps=24",
    "trainer.checkpoint_every=8",
    "trainer.keep_checkpoints=3",
    "trainer.progress=false",
    "sync.outer=diloco",
    "sync.period=5",
    "optim=adamw",
    "dist.timeout_s=60",
    "logger.wandb.mode=disabled",
    "logger.plots=false",
]
SHARDED = ["dist.world_size=4", "dist.shard_size=2"]


def _ok(proc) -> None:
    assert proc[0].returncode == 0, proc[0].stderr[-3000:]
    assert not proc[1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dcp") / "whole"
    _ok(cli(JOB + SHARDED + [f"hydra.run.dir={run_dir}"]))
    return run_dir


def _dcp_models(folder) -> list[dict]:
    """Every replica group's model in a sharded checkpoint, whole (read without processes)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(folder, "whole.pt")
    dcp_to_torch_save(os.path.join(folder, "dcp"), out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return [state[g]["model"] for g in sorted(state)]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sharded_run_killed_and_resumed_ends_bit_identical(uninterrupted, tmp_path):
    marker = json.loads((uninterrupted / "checkpoints/step-16" / checkpoint.MARKER).read_text())
    assert marker["shard_size"] == 2 and "dcp/.metadata" in marker["dcp_files"]
    run_dir = tmp_path / "killed"
    args = JOB + SHARDED + [f"hydra.run.dir={run_dir}"]
    proc, _ = cli(args, fault="kill:1:18")  # after the checkpoints at 8 and 16
    assert proc.returncode != 0
    # the newest checkpoint damaged (as by a kill mid-save): the one before it is used
    shard = run_dir / "checkpoints/step-16/dcp/__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    proc, left = cli(args)
    _ok((proc, left))
    assert "skipping checkpoint" in proc.stderr and "step-16/dcp/__1_0.distcp" in proc.stderr
    assert "resuming from" in proc.stderr and "step-8" in proc.stderr
    assert same_model(run_dir / "model.pt", uninterrupted / "model.pt")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sharded_checkpoint_resumes_with_another_shard_size_and_number_of_groups(
    uninterrupted, tmp_path
):
    at_sync = uninterrupted / "checkpoints/step-16"
    groups = _dcp_models(at_sync)
    assert all(torch.equal(groups[1][k], v) for k, v in groups[0].items())  # at a sync
    for layout, line in [
        (["dist.world_size=4", "dist.shard_size=1"], "2 group(s) of 2 become 4 group(s) of 1"),
        (["dist.world_size=2", "dist.shard_size=2"], "2 group(s) of 2 become 1 group(s) of 2"),
    ]:
        run_dir = tmp_path / layout[1].replace("=", "-")
        # nothing left to train: model.pt is the model every new worker started from
        args = JOB + layout + ["trainer.max_steps=16", f"trainer.resume={at_sync}"]
        proc, left = cli(args + [f"hydra.run.dir={run_dir}"])
        _ok((proc, left))
        assert f"resuming with another layout: {line}" in proc.stderr
        saved = torch.load(run_dir / "model.pt", weights_only=True)
        assert saved.keys() == groups[0].keys()
        for k, v in groups[0].items():
            assert torch.equal(saved[k], v), (layout, k)
    # between syncs, DiLoCo: every new worker starts from the anchor (the line says so)
    line = resume_line(str(uninterrupted / "checkpoints/step-8"), 2, 2)
    assert "the model of the last outer step (the anchor), dropping the 2 local steps" in line
    assert line.endswith("the data is re-partitioned")
    # the averager's flat anchors, cut back from the 2 shards, are DCP's whole model at a sync
    anchors = [
        torch.load(checkpoint.rank_file(str(at_sync), r), weights_only=True)["averager"]
        for r in range(2)
    ]
    shapes = [v.shape for v in groups[0].values()]
    whole = relayout([a["rounds"]["anchors"][0] for a in anchors], shapes, 1, 0)
    assert torch.equal(whole, torch.cat([v.reshape(-1) for v in groups[0].values()]))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_an_unsharded_checkpoint_resumes_sharded(tmp_path):
    unsharded = tmp_path / "unsharded"
    job = [a for a in JOB if a != "trainer.max_steps=24"] + ["trainer.max_steps=16"]
    _ok(cli(job + ["dist.world_size=4", f"hydra.run.dir={unsharded}"]))
    at_sync = unsharded / "checkpoints/step-16"  # after the outer step at 15: every rank alike
    run_dir = tmp_path / "sharded"
    proc, left = cli(job + SHARDED + [f"trainer.resume={at_sync}", f"hydra.run.dir={run_dir}"])
    _ok((proc, left))
    assert "resuming with another layout: 4 group(s) of 1 become 2 group(s) of 2" in proc.stderr
    # nothing left to train: the sharded groups hold the unsharded run's final model
    assert same_model(run_dir / "model.pt", unsharded / "model.pt")


def test_relayout_cuts_and_joins_dim_0_as_fsdp2_does():
    # 5 rows in 2 shards: 3 + 2; in 4: 2 + 2 + 1 + 0 (torch.chunk's pieces, FSDP2's)
    tensors = [torch.arange(10.0).view(5, 2), torch.arange(3.0) + 100, torch.arange(4.0).view(4, 1)]
    shapes = [t.shape for t in tensors]

    def flat(shards: int, s: int) -> torch.Tensor:
        parts = []
        for t in tensors:
            pieces = torch.chunk(t, shards)
            parts.append(pieces[s].reshape(-1) if s < len(pieces) else t.new_empty(0))
        return torch.cat(parts)

    old = [flat(2, s) for s in range(2)]
    assert torch.equal(relayout(old, shapes, 1, 0), flat(1, 0))
    for s in range(4):
        assert torch.equal(relayout(old, shapes, 4, s), flat(4, s)), s
    assert torch.equal(relayout([flat(4, s) for s in range(4)], shapes, 2, 1), old[1])


def test_the_averager_state_is_cut_to_the_new_shards_and_residuals_summed_over_the_groups():
    from types import SimpleNamespace

    from localsgd.averaging import FlatBuffers
    from localsgd.loop.checkpoint.averager_state import averager_state

    params = [torch.nn.Parameter(torch.zeros(5, 2)), torch.nn.Parameter(torch.zeros(3))]
    averager = SimpleNamespace(flat=FlatBuffers(params))  # the new layout: unsharded

    def whole(seed: int) -> torch.Tensor:  # laid out as the unsharded flat buffer: 10 + 3
        return torch.randn(13, generator=torch.Generator().manual_seed(seed))

    def shard(v: torch.Tensor, s: int) -> torch.Tensor:  # shard s of 2, as FSDP2 cuts dim 0
        return torch.cat([torch.chunk(v[:10].view(5, 2), 2)[s].reshape(-1), v[10:].chunk(2)[s]])

    anchor, momentum, residuals = whole(0), whole(1), [whole(2), whole(3)]  # residuals per group
    states = [  # 2 groups of 2: ranks 0, 1 (group 0), 2, 3 (group 1)
        {
            "averager": {
                "step": 7,
                "rounds": {
                    "anchors": [shard(anchor, s)],
                    "optimizers": [
                        {
                            "state": {0: {"momentum_buffer": shard(momentum, s)}},
                            "param_groups": [{"params": [0]}],
                        }
                    ],
                    "residuals": [[shard(residuals[g], s)]],  # part 0, one piece a buffer
                },
            }
        }
        for g in range(2)
        for s in range(2)
    ]
    out = averager_state(states, 2, averager, 1, 0)
    assert out["step"] == 7
    rounds = out["rounds"]
    assert torch.equal(rounds["anchors"][0], anchor)
    assert torch.equal(rounds["optimizers"][0]["state"][0]["momentum_buffer"], momentum)
    # every new worker: the old groups' residuals summed, over the old number of groups
    assert torch.equal(rounds["residuals"][0][0], (residuals[0] + residuals[1]) / 2)


def _fake_sharded_checkpoint(
    run_dir, config: dict, units: list[str] | None = None, shared: bool = False
) -> str:
    folder = checkpoint.step_dir(str(run_dir), 8)
    os.makedirs(folder)
    # a shared checkpoint (ft) is taken at a sync
    torch.save({"step": 8, "loop": {"in_sync": shared}}, checkpoint.rank_file(folder, 0))
    marker = {
        "step": 8,
        "world_size": 4,
        "shard_size": 2,
        "files": {"rank-0.pt": os.path.getsize(checkpoint.rank_file(folder, 0))},
        "dcp_files": {},
        "config": config,
    }
    if units is not None:
        marker["units"] = units
    if shared:
        marker.update(shared=True, group=0)
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump(marker, f)
    return folder


@pytest.mark.timeout(30)
def test_what_a_sharded_checkpoint_cannot_continue_is_refused_in_one_line(tmp_path, capsys):
    from localsgd.config import plain
    from tests.helpers import compose_config

    job = [a for a in JOB if a != "sync.period=5"] + ["sync=streaming_diloco", "sync.fragments=2"]
    folder = _fake_sharded_checkpoint(tmp_path / "old", plain(compose_config(job + SHARDED)))
    run = [f"hydra.run.dir={tmp_path / 'new'}", f"trainer.resume={folder}"]
    # fragments in flight are per group: another layout cannot take them over
    line = refusal(job + ["dist.world_size=4"] + run, capsys)
    assert (
        f"dist.world_size and dist.shard_size must stay 4 and 2 to resume {folder} with "
        "sync.delay_steps=1 (a fragment's average is in flight)"
    ) in line, line
    # a checkpoint of another model (other FSDP units) is refused, naming the key
    other = [a if a != "model.hidden=[16]" else "model.hidden=[32]" for a in job]
    line = refusal(other + SHARDED + run, capsys)
    assert "differs in model.hidden: [16] in the checkpoint, [32] now" in line, line
    # the same config, but the checkpoint's FSDP units differ (the model's code changed)
    units = ["net.1: net.1.weight[16, 32], net.1.bias[16]", "(root): "]
    folder = _fake_sharded_checkpoint(
        tmp_path / "units", plain(compose_config(JOB + SHARDED)), units
    )
    run = [f"hydra.run.dir={tmp_path / 'new2'}", f"trainer.resume={folder}"]
    line = refusal(JOB + SHARDED + run, capsys)
    assert line == (
        f"error: trainer.resume must name a checkpoint of this model's FSDP units, but {folder} "
        "was written with other units ('(root): ' in the checkpoint, 'net.4: net.4.weight[10, "
        "16], net.4.bias[10]' now); start afresh in another hydra.run.dir"
    ), line
    # a shared checkpoint (one replica group's, under ft) holds that group's layout of shards
    folder = _fake_sharded_checkpoint(
        tmp_path / "shared", plain(compose_config(JOB + SHARDED)), shared=True
    )
    run = [f"hydra.run.dir={tmp_path / 'new3'}", f"trainer.resume={folder}"]
    line = refusal(JOB + ["dist.world_size=4"] + run, capsys)
    assert line == (
        f"error: dist.shard_size must stay 2 to resume {folder}, a shared checkpoint (written "
        "under ft=torchft: one replica group's state, laid out for its 2 rank(s)), got 1"
    ), line


@pytest.mark.long  # three to five runs of 2-4 processes, ~1 min: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout, killed, resumed",
    [("torch_save", "cpu", "cpu"), ("dcp", "cpu", "cpu"), ("torch_save", "device", "cpu")],
)
def test_with_the_outer_state_on_the_host_a_killed_run_resumes_to_the_device_runs_model(
    uninterrupted, tmp_path, layout, killed, resumed
):
    """sync.outer_state=cpu: the anchors and outer momentum are saved from and loaded into host
    tensors, in the per-rank files of both layouts (unsharded: torch.save; sharded: beside the
    DCP save). Killed after step 13, the run resumes from step 8, between outer steps (anchor
    and momentum differ from the model), and ends with the device run's model, bit for bit;
    a device run's checkpoint may resume with the state on the host (the same bits)."""
    if layout == "dcp":
        args, reference = JOB + SHARDED, uninterrupted
    else:
        args, reference = JOB + ["dist.world_size=2"], tmp_path / "device"
        _ok(cli(args + [f"hydra.run.dir={reference}"]))
    run_dir = tmp_path / "host"
    args = args + [f"hydra.run.dir={run_dir}"]
    proc, _ = cli(args + [f"sync.outer_state={killed}"], fault="kill:1:13")
    assert proc.returncode != 0
    proc, left = cli(args + [f"sync.outer_state={resumed}"])
    _ok((proc, left))
    assert "resuming from" in proc.stderr and "step-8" in proc.stderr
    marker = json.loads((run_dir / "checkpoints/step-16" / checkpoint.MARKER).read_text())
    assert ("dcp/.metadata" in marker.get("dcp_files", [])) == (layout == "dcp")
    assert same_model(run_dir / "model.pt", reference / "model.pt")


@pytest.mark.timeout(30)
def test_a_shared_checkpoint_gives_each_rank_its_own_residuals_or_its_shards_over_the_groups(
    tmp_path,
):
    """Under ft a shared checkpoint holds the writing group's state; every rank of every group
    saved its own error-feedback residuals beside it. With the same groups each rank takes its
    own; as one group, shard s takes the old groups' shard-s residuals summed over 2."""
    from localsgd.loop.checkpoint.averager_state import own_residuals as _own_residuals

    folder = checkpoint.step_dir(str(tmp_path), 8)
    os.makedirs(folder)
    marker = {"step": 8, "world_size": 4, "shard_size": 2, "shared": True, "files": {}}
    with open(os.path.join(folder, checkpoint.MARKER), "w") as f:
        json.dump(marker, f)
    own = {r: [torch.full((3,), float(r + 1)), None] for r in range(4)}  # global rank r's
    for r, residuals in own.items():
        checkpoint.save_own(str(tmp_path), 8, r, {"residuals": residuals})
    for r in range(4):  # 2 groups of 2 again: each rank its own
        got = _own_residuals(folder, r, 4, 2, "cpu")
        assert torch.equal(got[0], own[r][0]) and got[1] is None
    for s in range(2):  # 1 group of 2: rank s holds shard s of both old groups
        got = _own_residuals(folder, s, 2, 2, "cpu")
        assert torch.equal(got[0], (own[s][0] + own[2 + s][0]) / 2), (s, got)


@pytest.mark.long  # three runs of 4 processes, ~30 s: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_sparseloco_killed_and_resumed_ends_bit_identical(tmp_path):
    """SparseLoCo over sharded replica groups: each rank sends top-k of its own shard's
    pseudo-gradient (chunks start at the shard's start), and its error-feedback residual, per
    shard, travels in the checkpoint: a run killed after step 16 resumes to the same bits."""
    args = (
        JOB
        + SHARDED
        + [
            "sync=sparseloco",
            "sync.period=5",
            "sync.topk_chunk=64",
            "sync.topk_mean=senders",
            "sync.error_feedback_decay=0.9",
        ]
    )
    whole, run_dir = tmp_path / "whole", tmp_path / "killed"
    _ok(cli(args + [f"hydra.run.dir={whole}", "sync.check_replicas=true"]))
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["replica_checks"] > 0 and summary["shard_size"] == 2
    proc, _ = cli(
        args + [f"hydra.run.dir={run_dir}", "sync.check_replicas=true"], fault="kill:1:18"
    )
    assert proc.returncode != 0
    _ok(cli(args + [f"hydra.run.dir={run_dir}", "sync.check_replicas=true"]))
    assert same_model(run_dir / "model.pt", whole / "model.pt")


@pytest.mark.long  # three runs of 4 processes, ~30 s: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_scored_sharded_sparseloco_run_killed_and_resumed_ends_bit_identical(tmp_path):
    """Untrusted workers over sharded replica groups and SparseLoCo's top-k wire, the second
    group's rank 3 sending NaN (the whole group's contribution dropped, whatever its other
    values): the verdicts and residuals travel in the checkpoint, and a run killed after step
    16 resumes to the same bits and verdicts."""
    attack = "{_target_:localsgd.loop.attacks.Attack,kind:nan,rank:3}"
    kill = "{_target_:tests.faults.Fault,spec:'kill:1:18'}"
    args = JOB + SHARDED + ["+experiment=untrusted_sparseloco", "sync.period=4",
                            "sync.topk_chunk=64", "sync.check_replicas=true"]  # fmt: skip
    whole, run_dir = tmp_path / "whole", tmp_path / "killed"
    _ok(cli(args + [f"trainer.callbacks=[{attack}]", f"hydra.run.dir={whole}"]))
    trust = json.loads((whole / "summary.json").read_text())["trust"]
    dropped = [w for w, _ in trust["dropped_nonfinite"]]
    assert dropped and set(dropped) == {1}  # every attacked round (the final average is not)
    proc, _ = cli(args + [f"trainer.callbacks=[{attack},{kill}]", f"hydra.run.dir={run_dir}"])
    assert proc.returncode != 0
    _ok(cli(args + [f"trainer.callbacks=[{attack}]", f"hydra.run.dir={run_dir}"]))
    assert same_model(run_dir / "model.pt", whole / "model.pt")
    assert json.loads((run_dir / "summary.json").read_text())["trust"] == trust

"""Sharded replica groups (`dist.shard_size`, localsgd/loop/fsdp.py): FSDP2 inside each
group, the averagers' mirror mode across groups.

The parity: 4 processes as 2 groups of 2 against 2 processes each holding the whole model, where
each replicated worker's batch is the union of its group's two half-batches. With a mean loss,
FSDP's gradient inside a group (the mean of the 2 ranks' mean gradients over equal halves) is
the replicated worker's gradient on the whole batch, so both runs do the same computation; only
the order of the sums differs (reduce-scatter adds two partial means; one worker sums 8 rows),
a few ulps per step. After 7-11 steps of a tiny model (weights of order 0.1-1) the largest
difference measured was 1.1e-7 (DiLoCo; 3e-8 plain): within atol 1e-6 / rtol 1e-5, while
averaging over every rank instead of the replicate group, or mirror mode not pushing the average
back, fails every case.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from localsgd.averaging import (
    FlatBuffers,
    HierarchicalAverager,
    OuterAverager,
    PeriodicAverager,
    StreamingAverager,
)
from localsgd.averaging.flat import local_tensor
from localsgd.averaging.optimizer_state import OptimizerStateSync
from localsgd.averaging.schedule import AdaptivePeriod
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.averaging.wire.sparse import TopKCodec
from localsgd.loop.fsdp import Sharding, state_bytes
from tests.helpers import FAST, cli, refusal, run_distributed

BATCH = 8  # rows per replica group and step; halved between a group's 2 ranks
CASES = {  # name: (steps, averager factory)
    "local_sgd": (7, lambda model, group: PeriodicAverager(3, process_group=group, module=model)),
    "diloco": (7, lambda model, group: OuterAverager(3, process_group=group, module=model)),
    "streaming": (  # fragment launches after steps 0, 4, 8; merges after 1, 5, 9
        11,
        lambda model, group: StreamingAverager(
            8, process_group=group, module=model, fragments=2, delay_steps=1, merge_alpha=0.5
        ),
    ),
    **{
        f"{dtype}_feedback": (
            7,
            lambda model, group, dtype=dtype: OuterAverager(
                3, process_group=group, module=model, comm_dtype=dtype, error_feedback=True
            ),
        )
        for dtype in ("int8", "int4")
    },
    # SparseLoCo's wire: top-k of each shard's pseudo-gradient (its chunks start at the
    # shard's start), 2-bit values, error feedback
    "topk_feedback": (
        7,
        lambda model, group: OuterAverager(
            3,
            process_group=group,
            module=model,
            comm_dtype=TopKCodec(0.25, 16, "senders"),
            error_feedback=True,
            outer_lr=1.0,
            outer_momentum=0.0,
            outer_nesterov=False,
        ),
    ),
}
# the settings each case turns on besides its averager: the optimizer state averaged with the
# parameters, a period adapted to the loss (fed the replica group's loss), and two levels whose
# narrower one (a replica group alone) makes subgroups of every shard's replicate group
CASES |= {
    "hierarchical": (
        9,
        lambda model, group: HierarchicalAverager({2: 1, 4: 2}, process_group=group, module=model),
    ),
    "moments_averaged": (7, CASES["diloco"][1]),
    "adaptive": (
        12,
        lambda model, group: PeriodicAverager(
            2, process_group=group, module=model, schedule=AdaptivePeriod(2, 1, 8, tolerance=0.05)
        ),
    ),
}
ADAM = (
    "diloco",
    "diloco_cpu",
    "moments_averaged",
    "int8_feedback",
    "int4_feedback",
    "topk_feedback",
)
EXACT = [
    "local_sgd",
    "diloco",
    "streaming",
    "hierarchical",
    "moments_averaged",
    "adaptive",
    "clip",
    "nan_in_one_shard",
    "scored",
    "streaming_scored",
]
# (low bits: their blocks start at each shard's start)
# sync.outer_state=cpu (localsgd/averaging/offload.py): each must give its device case's bits
OFFLOADED = {
    "diloco_cpu": (7, lambda model, group: OuterAverager(
        3, process_group=group, module=model, outer_state="cpu")),
    "streaming_cpu": (11, lambda model, group: StreamingAverager(
        8, process_group=group, module=model, fragments=2, delay_steps=1, merge_alpha=0.5,
        outer_state="cpu")),
}  # fmt: skip  # low bits: blocks start at each shard's start


def _timeout(group) -> float | None:
    if group is None:
        return None
    backend = group._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def _held_out(model):
    """A held-out loss per sample that every rank evaluates alike (sharded: FSDP's forward, a
    collective of the replica group)."""

    def loss_at(round_: int) -> torch.Tensor:
        x, y = _batch(99, round_, 0, 1)
        with torch.no_grad():
            return nn.functional.cross_entropy(model(x), y, reduction="none").double()

    return loss_at


def _tamper(kind: str, model, anchor, replica: int, shard: int | None) -> None:
    """Replica 1's contribution before a sync: scaled 5x (`scale`), -10x (`sign_flip`), or NaN
    at row 12 of the first weight (`nan`): a value the second shard of a group holds (rows
    8-15 of 16), so the first shard's rows of that contribution stay finite."""
    if replica != 1:
        return
    with torch.no_grad():
        params = [local_tensor(p) for p in model.parameters()]
        if kind == "nan":
            if shard is None:
                params[0][12, 0] = float("nan")
            elif shard == 1:
                params[0][4, 0] = float("nan")
            return
        factor = 5.0 if kind == "scale" else -10.0
        for p, a in zip(params, anchor, strict=True):
            p.copy_(a + factor * (p - a))


# robust rounds over sharded parameters (localsgd.averaging.trust.trusted_round with `mirror`):
# each against
# the replicated run with the same replica attacking. clip needs each contribution's norm over
# both shards, the NaN in one shard must drop the whole contribution on every shard, and the
# judge must evaluate the candidate written into the sharded parameters; each fails without.
TRUSTED = {  # name: (steps, averager factory (model, group), attack)
    "clip": (7, lambda model, group: OuterAverager(
        3, process_group=group, module=model, aggregate=Aggregate("clip", clip_multiple=1.0)),
        "scale"),
    "nan_in_one_shard": (7, lambda model, group: PeriodicAverager(
        3, process_group=group, module=model, aggregate=Aggregate("median")), "nan"),
    "scored": (7, lambda model, group: PeriodicAverager(
        3, process_group=group, module=model, aggregate=Aggregate("mean"),
        judge=Judge(_held_out(model), exclude_after=0)), "sign_flip"),
    # Streaming DiLoCo's blocking fragments (a fragment sync every 4 steps), each round clipped
    # and scored with the other fragment at its anchor
    "streaming_scored": (11, lambda model, group: StreamingAverager(
        8, process_group=group, module=model, fragments=2, aggregate=Aggregate(
            "clip", clip_multiple=1.0), judge=Judge(_held_out(model), exclude_after=0)),
        "sign_flip"),
}  # fmt: skip


def _model() -> nn.Module:
    torch.manual_seed(0)
    # even widths: each rank of a group holds exactly half of every tensor
    layers = [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def _batch(group: int, step: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica group `group`'s batch at `step`, the `part`-th of `parts` equal slices."""
    gen = torch.Generator().manual_seed(1000 * group + step)
    x, y = torch.randn(BATCH, 6, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)
    rows = slice(part * BATCH // parts, (part + 1) * BATCH // parts)
    return x[rows], y[rows]


def _train(rank: int, world: int, shard_size: int) -> dict:
    """Every case on this rank: the whole final model, its state bytes, and how many times the
    averager copied the shards in (mirror mode only)."""
    torch.set_num_threads(1)
    sharding = Sharding(shard_size, world, torch.device("cpu"))
    pulls = {"n": 0, "held": 0}
    original = FlatBuffers.pull

    def counted(self):
        pulls["n"] += 1
        original(self)
        pulls["held"] = max(pulls["held"], self.held_bytes)  # the mirror while a step acts

    FlatBuffers.pull = counted
    out = {}
    every = {**CASES, **OFFLOADED, **{k: (s, m) for k, (s, m, _) in TRUSTED.items()}}
    for name, (steps, make) in every.items():
        pulls["n"] = pulls["held"] = 0
        model = sharding.shard(_model())
        # momentum / AdamW: optimizer state to shard
        opt = (
            torch.optim.AdamW(model.parameters(), lr=0.01)
            if name in ADAM
            else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        averager = make(model, sharding.replicate_group)
        anchor = [local_tensor(p).detach().clone() for p in model.parameters()]
        if name == "moments_averaged":
            averager.hooks.append(OptimizerStateSync(opt, "average"))
        periods, acting = [], 0
        for step in range(steps):
            x, y = _batch(rank // shard_size, step, rank % shard_size, shard_size)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if averager.needs_loss:
                averager.observe_loss(sharding.group_mean(loss))
            acts = averager.acts_at(step)
            acting += acts  # (asked before: adaptive's answer changes)
            if name in TRUSTED and acts:
                shard = rank % shard_size if sharding.sharded else None
                _tamper(TRUSTED[name][2], model, anchor, rank // shard_size, shard)
            averager.maybe_average()
            if acts:  # the model every replica holds now
                anchor = [local_tensor(p).detach().clone() for p in model.parameters()]
            periods.append(getattr(averager, "period", None))
        averager.average()
        full = sharding.full_state(model) or model.state_dict()
        out[name] = {
            "model": {k: v.detach().clone() for k, v in full.items()},
            "bytes": state_bytes(model, opt, averager),
            "pulls": pulls["n"],
            "mirror_at_rounds": pulls["held"],
            "acting_steps": acting,
            "periods": periods,
            "events": list(averager.rounds.trust.events) if name in TRUSTED else [],
            # each group's collective timeout (the harness sets the default group's to 60 s)
            "timeouts": [_timeout(level.group) for level in averager.levels]
            + [_timeout(sharding.shard_group)],
            "moments": [
                {k: v.full_tensor() for k, v in st.items() if k != "step"}
                if sharding.sharded
                else {k: v for k, v in st.items() if k != "step"}
                for st in opt.state.values()
            ],
        }
    FlatBuffers.pull = original
    return out


@pytest.fixture(scope="module")
def runs():
    sharded = run_distributed(_train, 4, 2, timeout_s=60)
    replicated = run_distributed(_train, 2, 1, timeout_s=60)
    return sharded, replicated


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", EXACT)
def test_sharded_groups_train_as_replicated_workers_on_the_union_of_their_batches(runs, case):
    sharded, replicated = runs
    for rank, result in enumerate(sharded):
        ref = replicated[rank // 2][case]["model"]
        got = result[case]["model"]
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{case} {k}")
    # after the final average every group holds the same shards: the same model, bit for bit
    for result in sharded[1:]:
        for k, v in sharded[0][case]["model"].items():
            assert torch.equal(result[case]["model"][k], v), (case, k)
    assert not torch.equal(sharded[0][case]["model"]["0.weight"], _model()[0].weight.detach())
    if case in TRUSTED:  # the same verdicts on every rank, sharded or not
        events = replicated[0][case]["events"]
        assert all(r[case]["events"] == events for r in sharded + replicated), case
        whys = {
            "clip": set(),
            "nan_in_one_shard": {"nonfinite"},
            "scored": {"bad"},
            "streaming_scored": {"bad"},
        }[case]
        assert {e["why"] for e in events} == whys and {e["rank"] for e in events} <= {1}
    periods = [result[case]["periods"] for result in sharded + replicated]
    assert all(p == periods[0] for p in periods), periods  # every shard index adapts alike
    if case == "adaptive":
        assert len(set(periods[0])) > 1, periods[0]  # the period did adapt
    if case == "moments_averaged":  # as the parameters: the replicated workers' moments
        for rank, result in enumerate(sharded):
            for got, ref in zip(
                result[case]["moments"], replicated[rank // 2][case]["moments"], strict=True
            ):
                for k in ref:
                    torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype, qmax", [("int8", 127), ("int4", 7)])
def test_low_bits_with_error_feedback_stay_within_one_quantisation_step_of_replicated(
    runs, dtype, qmax
):
    # the blocks (one scale each) start at each shard's start, so the sharded run rounds other
    # blocks than the replicated one: equal up to the rounding, which error feedback carries;
    # one step of these weights (|w| < 0.5) is 0.5/qmax (int8: 4e-3, int4: 7e-2)
    sharded, replicated = runs
    case = f"{dtype}_feedback"
    for rank, result in enumerate(sharded):
        ref, got = replicated[rank // 2][case]["model"], result[case]["model"]
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0.5 / qmax, msg=k)
            assert torch.equal(got[k], sharded[0][case]["model"][k]), k


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_every_group_made_from_the_default_one_keeps_its_timeout(runs):
    # torch gives a device mesh's groups and new subgroups the backend's default timeout (30
    # minutes for gloo), not the default group's; a hung peer would hold the rest that long
    sharded, replicated = runs
    for result in sharded:  # the levels (2 and 1 replica groups), each shard's replicate
        # group, and the replica group FSDP gathers in
        assert result["hierarchical"]["timeouts"] == [60.0, 60.0, 60.0]
        assert result["diloco"]["timeouts"] == [60.0, 60.0]
    for result in replicated:  # unsharded: a level of one worker, the default group
        assert result["hierarchical"]["timeouts"] == [60.0, None, None]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sharded_top_k_ends_with_every_group_on_the_same_bits(runs):
    # top-k picks within each shard's chunks, so what is sent differs from the replicated
    # run's (after 2 rounds at 1/4 density the models differ by up to half of how far they
    # moved: no parity to test); every group must still end on the same bits
    sharded, _ = runs
    start = _model().state_dict()
    for result in sharded:
        for k, v in result["topk_feedback"]["model"].items():
            assert torch.equal(v, sharded[0]["topk_feedback"]["model"][k]), k
            assert not torch.equal(v, start[k]), k


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_holds_half_the_state_and_copies_only_at_steps_that_act(runs, case):
    sharded, replicated = runs
    one, two = replicated[0][case]["bytes"], sharded[0][case]["bytes"]
    for part in ("parameters", "gradients", "optimizer"):
        assert two[part] > 0
    # parameter + optimizer bytes: at most half of the unsharded rank's, plus 5%
    held = two["parameters"] + two["optimizer"]
    assert held <= 0.5 * (one["parameters"] + one["optimizer"]) * 1.05, (two, one)
    # everything a rank holds between steps, the averager's state included: at most half of
    # the unsharded rank's, plus 5% (the memory target)
    assert two["total"] <= 0.5 * one["total"] * 1.05, (two, one)
    # the mirrored copy of the shards exists only while a step acts, released after it
    assert two["averager_parts"]["mirror"] == 0
    # (the largest copy pulled: the parameters, with the adaptive schedule's loss slot, or
    # Adam's two moments where the optimizer state is averaged too)
    mirrored = {"adaptive": two["parameters"] + 4, "moments_averaged": 2 * two["parameters"]}
    assert sharded[0][case]["mirror_at_rounds"] == mirrored.get(case, two["parameters"])
    assert one["averager_parts"]["mirror"] == 0
    # the averager's state is sharded too (anchors, outer momentum)
    for part in ("anchors", "outer_momentum", "residuals"):
        assert two["averager_parts"][part] <= 0.5 * one["averager_parts"][part] * 1.05
    # one pull per step that acts, one for the final average, one for the initial broadcast of
    # an anchored averager: none in the local phase
    result = sharded[0][case]
    assert 0 < result["acting_steps"] < CASES[case][0]  # some steps are local
    anchored = case not in ("local_sgd", "hierarchical", "adaptive")  # broadcast at the start
    if case.endswith("_feedback"):
        assert two["averager_parts"]["residuals"] == two["parameters"]  # one per local value
    averages = result["acting_steps"] + 1
    moments = averages if case == "moments_averaged" else 0  # the moments pulled at each
    assert result["pulls"] == averages + anchored + moments
    assert replicated[0][case]["pulls"] == 0  # unsharded: the parameters are the buffers


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_outer_state_on_the_host_gives_the_device_bits_sharded_and_not(runs):
    # both runs (4 ranks as 2 x 2, and 2 replicated ranks): the whole final model equal bit for
    # bit, and the anchors and outer momentum counted in host memory, no longer on the device
    for results in runs:
        for result in results:
            for name in OFFLOADED:
                device = result[name.removesuffix("_cpu")]
                for k, v in device["model"].items():
                    assert torch.equal(result[name]["model"][k], v), (name, k)
                held, ref = result[name]["bytes"], device["bytes"]
                outer = ref["averager_parts"]["anchors"] + ref["averager_parts"]["outer_momentum"]
                assert ref["averager_parts"]["anchors"] == held["host"]["anchors"] > 0
                assert held["host"]["outer_momentum"] == ref["averager_parts"]["outer_momentum"]
                assert held["total"] == ref["total"] - outer, (held, ref)
                assert held["host"]["staging"] == held["host"]["anchors"]  # this rank's shards
                assert "host" not in ref


@pytest.mark.slow
@pytest.mark.long  # 4 processes, FSDP2, ~12 s: `make test-long`
@pytest.mark.timeout(120)
def test_the_cli_scores_streaming_fragments_of_sharded_replica_groups(tmp_path):
    """`+experiment=untrusted_streaming` over 2 replica groups of 2, both ranks of the second
    flipping their fragment's change: every fragment round judges it bad (2 groups: dropped,
    never excluded), and every sync leaves the groups bit-identical."""
    attack = ",".join(
        f"{{_target_:localsgd.loop.attacks.Attack,kind:sign_flip,rank:{r}}}" for r in (2, 3)
    )
    run = tmp_path / "run"
    proc, _ = cli(["+experiment=untrusted_streaming", "dist.world_size=4", "dist.shard_size=2",
                   "trainer.max_steps=96", "sync.check_replicas=true", "logger.plots=false",
                   "logger.wandb.mode=disabled", f"trainer.callbacks=[{attack}]",
                   f"hydra.run.dir={run}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    trust = summary["trust"]
    # a fragment sync every 12 steps (4 fragments, H = 48): 8 attacked rounds, then the final
    # average's 4 fragment rounds, where the attack does not act
    assert trust["trust_rounds"] == 12 and trust["excluded"] == {}
    assert trust["judged_bad"] == [[1, r] for r in range(8)]
    assert "nobody can be excluded" in proc.stderr
    assert summary["replica_checks"] > 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_cli_trains_sharded_diloco_and_reports_state_bytes(tmp_path):
    run_dir = tmp_path / "run"
    args = FAST + [
        "dist.world_size=4",
        "dist.shard_size=2",
        "sync.outer=diloco",  # period 16: outer steps after steps 0, 16, 32, and a final one
        "sync.outer_state=cpu",  # the anchors and outer momentum held apart, in host memory
        "sync.check_replicas=true",  # each shard bit-identical across the groups at each sync
        "optim=adamw",
        "trainer.max_steps=40",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc, left = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["shard_size"] == 2 and summary["replica_checks"] == summary["comm_rounds"] == 4
    held = summary["state_bytes"]
    whole = summary["params"] * 4
    assert whole / 2 <= held["parameters"] <= whole / 2 * 1.05
    assert held["averager_parts"]["mirror"] == 0  # released between steps
    # sync.outer_state=cpu: anchor, momentum and staging (this rank's shards) counted apart,
    # and one line says that on a CPU run that saves nothing
    assert held["host"] == {
        "total": 3 * held["parameters"],
        "anchors": held["parameters"],
        "outer_momentum": held["parameters"],
        "staging": held["parameters"],
    }
    assert held["averager"] == 0
    assert proc.stderr.count("sync.outer_state=cpu on a CPU run saves nothing") == 1
    # the peak allocated is CUDA's counter: absent on CPU, not zero
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "peak_allocated_bytes" not in summary and not any(
        "peak_allocated_bytes" in x for x in lines
    )
    # every rank sends its shard, not the model: 4 outer steps
    assert summary["comm_bytes"] == 4 * held["parameters"]
    # the replica group's total: both ranks' shards, the whole model's bytes per outer step
    assert summary["comm_bytes_group"] == 4 * summary["params"] * 4
    saved = torch.load(os.path.join(run_dir, "model.pt"), weights_only=True)
    assert sum(v.numel() for v in saved.values()) == summary["params"]  # gathered whole


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_cli_adapts_the_period_to_the_group_loss_and_averages_the_sharded_moments(tmp_path):
    run_dir = tmp_path / "run"
    args = FAST + [
        "dist.world_size=4",
        "dist.shard_size=2",
        "sync.schedule=adaptive",
        "sync.period=4",
        "sync.optimizer_state=average",
        "sync.check_replicas=true",
        "optim=adamw",
        "trainer.max_steps=24",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc, left = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    summary = json.loads((run_dir / "summary.json").read_text())
    # every round checked bit-identical across the groups; a constant period would make 6
    assert summary["replica_checks"] == summary["comm_rounds"] != 6
    # each round sends this rank's shard of the parameters, Adam's 2 moments and the loss slot
    shard = summary["state_bytes"]["parameters"]
    assert summary["comm_bytes"] == summary["comm_rounds"] * (3 * shard + 4)
    # the other shard index adapted alike (fed the group's loss): as many rounds, as many bytes
    assert summary["comm_bytes_group"] == 2 * summary["comm_bytes"]


@pytest.mark.parametrize(
    "extra, named",
    [
        (["dist.shard_size=3"], "dist.shard_size must be a divisor of the world size (4 workers)"),
        # one machine without torchrun: each worker a replica group of one process
        (["ft=torchft"], "ft=torchft with dist.shard_size > 1 on one machine"),
        (["trainer.nan_policy=skip"], "dist.shard_size > 1 with trainer.nan_policy=skip"),
        (["dist.shard_size=0"], "dist.shard_size must be an integer >= 1, got 0"),
        # a level's group_size counts replica groups (2 here), not ranks
        (
            ["sync.levels=[{group_size:4,period:4},{group_size:world,period:8}]"],
            "sync.levels[0].group_size must be a divisor of 2 replica groups of 2 ranks, got 4",
        ),
        (
            ["sync.levels=[{group_size:3,period:4},{group_size:world,period:8}]"],
            "a divisor of 2 replica groups of 2 ranks, got 3",
        ),
    ],
)
@pytest.mark.timeout(30)
def test_what_sharding_does_not_combine_with_is_refused_in_one_line(extra, named, tmp_path, capsys):
    args = FAST + ["dist.world_size=4", "dist.shard_size=2", "trainer.checkpoint_every=0"]
    line = refusal(args + extra + [f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert named in line, line


@pytest.mark.timeout(10)
def test_mirrored_buffers_hold_copies_rebind_nothing_and_copy_only_when_asked():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(2, 2))
    storages = (a.data_ptr(), b.data_ptr())
    flat = FlatBuffers([a, b], mirror=True)
    assert (a.data_ptr(), b.data_ptr()) == storages and flat.is_bound()
    assert flat.rebind() is None
    flat.buffers[0].fill_(5.0)
    assert torch.equal(a.detach(), torch.ones(3))  # a copy: the parameter is untouched
    flat.push()
    assert torch.equal(a.detach(), torch.full((3,), 5.0)) and float(b.detach().sum()) == 20.0
    # released until the next pull; the tensors hold the values, a copy can be had meanwhile
    view = flat.views[0]
    assert flat.held_bytes == 0 and flat.released
    assert torch.equal(flat.current()[0][:3], torch.full((3,), 5.0))
    with torch.no_grad():
        a.add_(1.0)
    flat.pull()
    assert flat.held_bytes == flat.nbytes == 7 * 4 and flat.views[0] is view
    assert torch.equal(flat.buffers[0][:3], torch.full((3,), 6.0))
    assert torch.equal(view, torch.full((3,), 6.0))  # the views survive the release
    # the default (rebinding) mode makes the parameters views of the buffer
    plain = FlatBuffers([a, b])
    assert a.data_ptr() == plain.buffers[0].data_ptr()


@pytest.mark.timeout(30)
def test_a_checkpoint_from_before_the_key_counts_as_shard_size_1():
    # (the key may change for a checkpoint of one state per rank: cli/preflight.py)
    from localsgd.config import plain
    from localsgd.loop.checkpoint import config_mismatch
    from tests.helpers import compose_config

    old = plain(compose_config([]))
    del old["dist"]["shard_size"]  # written before dist.shard_size existed
    assert config_mismatch({"config": old}, plain(compose_config([]))) is None
    diff = config_mismatch({"config": old}, plain(compose_config(["dist.shard_size=2"])))
    assert diff == "dist.shard_size: 1 in the checkpoint, 2 now"


@pytest.mark.timeout(10)
def test_a_replica_group_spanning_machines_is_refused():
    # torchrun, 2 machines of 4 workers: a group of 8 would put FSDP's per-step collectives
    # on the network
    from localsgd.cli.checks import validate
    from localsgd.config import ConfigError
    from tests.helpers import compose_config

    validate(compose_config(["dist.shard_size=2"]), world_size=8, local_world_size=4)
    validate(compose_config(["dist.shard_size=8"]), world_size=8)  # one machine
    refused = (
        r"^dist\.shard_size must be a divisor of the workers per machine \(4, LOCAL_WORLD_SIZE\), "
        r"got 8: a replica group would span machines$"
    )
    with pytest.raises(ConfigError, match=refused):
        validate(compose_config(["dist.shard_size=8"]), world_size=8, local_world_size=4)


@pytest.mark.timeout(10)
def test_every_rank_enumerates_the_same_subgroups_of_the_replicate_groups(monkeypatch):
    """`sync.levels` sharded: the subgroups of a level are made by every rank of the default
    group from one enumeration (torch matches groups by creation order), so a rank must list
    the other shards' subgroups too, not only its own replicate group's. 8 ranks as 4 replica
    groups of 2: levels of 2 replica groups, simulated in one process."""
    from localsgd.averaging import comm as comm_module

    groups = {r: [r % 2 + 2 * i for i in range(4)] for r in range(8)}  # shard index r % 2
    seen = {}
    for rank in range(8):
        monkeypatch.setattr(
            comm_module.dist, "get_world_size", lambda g=None: 8 if g is None else 4
        )
        monkeypatch.setattr(
            comm_module.dist, "get_process_group_ranks", lambda g, r=rank: groups[r]
        )
        monkeypatch.setattr(
            comm_module.dist,
            "all_gather_object",
            lambda out, obj: out.__setitem__(slice(None), [groups[r] for r in range(8)]),
        )
        monkeypatch.setattr(
            comm_module.dist,
            "new_subgroups_by_enumeration",
            lambda chunks, r=rank, **_: (seen.__setitem__(r, chunks), (None, None))[1],
        )
        monkeypatch.setattr(comm_module, "supports_avg", lambda group: False)
        comm = object.__new__(comm_module.Communicator)
        comm.group, comm.size, comm.stats, comm.link = object(), 4, None, None
        comm.guard, comm.dropped = True, []
        comm.subgroups(2)
    assert all(chunks == seen[0] for chunks in seen.values()), seen
    assert seen[0] == [[0, 2], [4, 6], [1, 3], [5, 7]]


@pytest.mark.timeout(30)
def test_dist_shard_blocks_names_the_fsdp_units_and_a_wrong_name_is_refused(
    monkeypatch, tmp_path, capsys
):
    from localsgd.loop import fsdp as sharding_module
    from localsgd.loop.checkpoint.relayout import fsdp_units
    from localsgd.models.transformer import GPT

    model = GPT(vocab_size=11, d_model=8, n_heads=2, n_layers=2, max_len=4)
    wrapped = []
    monkeypatch.setattr(
        "torch.distributed.fsdp.fully_shard", lambda module, **kw: wrapped.append(module)
    )
    sharding = object.__new__(Sharding)
    sharding.mesh, sharding.blocks_path = {"shard": None}, "blocks.0"  # the first block's parts
    sharding_module.Sharding.shard(sharding, model)
    block = model.blocks[0]
    assert wrapped == [block.ln1, block.attn, block.ln2, block.mlp, model]
    units = fsdp_units(model, "blocks.0")
    assert [u.split(":")[0] for u in units] == [
        "blocks.0.ln1",
        "blocks.0.attn",
        "blocks.0.ln2",
        "blocks.0.mlp",
        "(root)",
    ]
    assert [u.split(":")[0] for u in fsdp_units(model)] == ["blocks.0", "blocks.1", "(root)"]
    args = FAST + ["dist.world_size=4", "dist.shard_size=2", "trainer.checkpoint_every=0"]
    for name, why in [("nope", "names no submodule of"), ("net.0", "has no child module")]:
        line = refusal(args + [f"dist.shard_blocks={name}", f"hydra.run.dir={tmp_path}"], capsys)
        assert line.startswith(f"error: dist.shard_blocks={name}: ") and why in line, line

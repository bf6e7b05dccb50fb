"""Slow workers (localsgd/loop/pacing.py): per-worker step counts in a time budget
(`sync.inner_time_s`), averages weighted by the samples each worker trained on, and the
deterministic slow-worker model (`comm.simulate.worker_speed`, `comm.simulate.step_s`)."""

from __future__ import annotations

import json

import pytest
import torch

from localsgd.averaging import OuterAverager, PeriodicAverager
from tests.helpers import FAST, cli, refusal, run_distributed, same_model

WEIGHTS = [1.0, 2.0, 5.0]  # samples each of 3 workers trained on this round
NAMES = (
    "local_sgd", "diloco", "diloco_int8", "diloco_bf16",
    "local_sgd_normalized", "diloco_normalized", "diloco_int8_normalized",
)  # fmt: skip


def _inner_steps(model: torch.nn.Module, rank: int) -> None:
    with torch.no_grad():  # this worker's own moves away from the anchor
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)  # every worker's own values: the replicas differ before the sync
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _weighted_worker(rank: int, world: int, weights: list[float]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name in NAMES:
        model = _model(rank)
        before = [p.detach().clone() for p in model.parameters()]
        wire = "int8" if "int8" in name else "bfloat16" if "bf16" in name else "float32"
        if name.startswith("diloco") or name == "local_sgd_normalized":
            # anchored on rank 0's model
            if name.startswith("diloco"):
                averager = OuterAverager(1, module=model, comm_dtype=wire, quant_block_size=8)
            else:
                averager = PeriodicAverager(1, module=model, round_starts=True)
            anchor = [p.detach().clone() for p in model.parameters()]
            _inner_steps(model, rank)
            before = [p.detach().clone() for p in model.parameters()]
        else:
            averager = PeriodicAverager(1, module=model)
            anchor = None
        averager.weighted = True
        averager.normalized = name.endswith("normalized")
        averager.trained(weights[rank])
        averager.maybe_average()
        out[name] = {
            "before": before,
            "anchor": anchor,
            "after": [p.detach().clone() for p in model.parameters()],
            "round_weights": averager.round_weights,
            "bytes": averager.stats.bytes,
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_weighted_round_is_the_samples_weighted_mean_computed_in_one_process():
    runs = run_distributed(_weighted_worker, 3, WEIGHTS, timeout_s=60)
    total = sum(WEIGHTS)
    # plain local SGD: the parameters' weighted mean
    for i in range(4):
        expected = sum(
            w / total * r["local_sgd"]["before"][i] for w, r in zip(WEIGHTS, runs, strict=True)
        )
        for r in runs:
            torch.testing.assert_close(r["local_sgd"]["after"][i], expected, rtol=0, atol=1e-6)
            assert torch.equal(r["local_sgd"]["after"][i], runs[0]["local_sgd"]["after"][i])
    # DiLoCo: the weighted mean pseudo-gradient, then the outer Nesterov step (lr 0.7, m 0.9)
    # from the anchor, written out in one process
    for i in range(4):
        anchor = runs[0]["diloco"]["anchor"][i]
        delta = sum(
            w / total * (anchor - r["diloco"]["before"][i])
            for w, r in zip(WEIGHTS, runs, strict=True)
        )
        buf = delta.clone()  # the first momentum step: the buffer is the gradient
        expected = anchor - 0.7 * (delta + 0.9 * buf)
        for r in runs:
            torch.testing.assert_close(r["diloco"]["after"][i], expected, rtol=0, atol=1e-6)
    # low-precision wires: the int8 messages (all-gathered, decoded, each scaled by its weight)
    # and the bf16 all-reduce land on the weighted formula within their rounding, far from the
    # unweighted mean, with the same bits on every rank
    for name, tol in (("diloco_int8", 0.02), ("diloco_bf16", 0.01)):
        for i in range(4):
            anchor = runs[0][name]["anchor"][i]
            deltas = [anchor - r[name]["before"][i] for r in runs]
            weighted = sum(w / total * d for w, d in zip(WEIGHTS, deltas, strict=True))
            got = (anchor - runs[0][name]["after"][i]) / (0.7 * 1.9)  # the first Nesterov step
            assert (got - weighted).abs().max() < tol, (name, i)
            unweighted = sum(deltas) / len(deltas)
            assert (unweighted - weighted).abs().max() > 10 * tol
            assert all(torch.equal(r[name]["after"][i], runs[0][name]["after"][i]) for r in runs)
    # normalized (sync.budget_merge=normalized, the default): each worker's change scaled by the
    # largest weight over its own before the weighted mean, i.e. the changes summed x max / total
    scale, far = max(WEIGHTS) / total, 0.0
    for i in range(4):
        anchor = runs[0]["local_sgd_normalized"]["anchor"][i]
        expected = anchor + scale * sum(
            r["local_sgd_normalized"]["before"][i] - anchor for r in runs
        )
        for r in runs:
            got = r["local_sgd_normalized"]["after"][i]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            assert torch.equal(got, runs[0]["local_sgd_normalized"]["after"][i])
        anchor = runs[0]["diloco_normalized"]["anchor"][i]
        delta = scale * sum(anchor - r["diloco_normalized"]["before"][i] for r in runs)
        expected = anchor - 0.7 * (delta + 0.9 * delta)
        for r in runs:
            got = r["diloco_normalized"]["after"][i]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        anchor = runs[0]["diloco_int8_normalized"]["anchor"][i]
        deltas = [anchor - r["diloco_int8_normalized"]["before"][i] for r in runs]
        got = (anchor - runs[0]["diloco_int8_normalized"]["after"][i]) / (0.7 * 1.9)
        # within the wire's rounding of changes up to 5x larger, far from the weighted mean
        assert (got - scale * sum(deltas)).abs().max() < 0.1
        weighted = sum(w / total * d for w, d in zip(WEIGHTS, deltas, strict=True))
        far = max(far, (got - weighted).abs().max().item())
    assert far > 1.0
    for r in runs:
        assert r["local_sgd"]["round_weights"] == WEIGHTS
        params = sum(p.numel() for p in r["local_sgd"]["before"])
        assert r["local_sgd"]["bytes"] == 4 * params + 8 * 3  # the model, then 3 fp64 weights


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_equal_weights_give_the_plain_mean_bit_for_bit():
    equal = run_distributed(_weighted_worker, 3, [4.0, 4.0, 4.0], timeout_s=60)
    plain = run_distributed(_plain_worker, 3, timeout_s=60)
    for weighted, unweighted in zip(equal, plain, strict=True):
        for name in ("local_sgd", "local_sgd_normalized"):
            for got, ref in zip(weighted[name]["after"], unweighted[name], strict=True):
                assert torch.equal(got, ref)


def _plain_worker(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    torch.set_num_threads(1)
    out = {}
    for name, starts in (("local_sgd", False), ("local_sgd_normalized", True)):
        model = _model(rank)
        averager = PeriodicAverager(1, module=model, round_starts=starts)
        if starts:
            _inner_steps(model, rank)
        averager.maybe_average()
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


def _unscalable_worker(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    averager = PeriodicAverager(1, module=_model(rank))  # the plain mean keeps no round start
    averager.weighted = averager.normalized = True
    averager.trained(WEIGHTS[rank])
    try:
        averager.maybe_average()
    except ValueError as e:
        return str(e)
    return "averaged"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_normalized_round_over_plain_rounds_without_the_round_start_is_refused():
    for said in run_distributed(_unscalable_worker, 3, timeout_s=60):
        assert "does not keep: build the averager with round_starts=True" in said


JOB = FAST + [
    "dist.world_size=4",
    "trainer.max_steps=48",
    "trainer.checkpoint_every=0",
    "sync.period=8",
]
SLOW = ["comm.simulate.worker_speed=[1,1,1,3]", "comm.simulate.step_s=0.002"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_budget_under_a_robust_rule_paces_the_slow_worker_and_weighs_nobody(tmp_path):
    """The median combines a budget's rounds unweighted (an untrusted worker could inflate the
    samples it reports): the paced run, worker 3 three times slower and worker 1 flipping its
    change's sign, trains to the end on bit-identical replicas, and no round is weighted."""
    attack = "{_target_:localsgd.loop.attacks.Attack,kind:'sign_flip',rank:1}"
    run = tmp_path / "run"
    args = JOB + SLOW + ["sync.inner_time_s=0.016", "sync.aggregate=median",
                         "sync.check_replicas=true", f"trainer.callbacks=[{attack}]",
                         f"hydra.run.dir={run}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["computed_steps"] == 48 and summary["replica_checks"] > 0  # rank 0: on time
    assert "round_weights" not in summary and "contributed_samples" not in summary


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_cli_paces_a_simulated_slow_worker_and_nobody_late_is_todays_model(tmp_path):
    runs = {
        "plain": JOB,
        # a budget everyone keeps: the same model as without one, bit for bit
        "on_time": JOB + ["sync.inner_time_s=100"],
        # worker 3 three times slower, a budget of 8 steps at speed 1: it computes 2 of a
        # round's 8 steps, the others all 8
        "paced": JOB + SLOW + ["sync.inner_time_s=0.016"],
        # the same as Streaming DiLoCo: each fragment's rounds weigh every sample once
        "fragments": JOB + SLOW + ["sync.inner_time_s=0.016", "sync.outer=diloco",
                                   "sync.fragments=2"],
        # the same, stopped after 24 steps with a checkpoint, then extended to 48
        "first_half": JOB + SLOW + ["sync.inner_time_s=0.016", "trainer.max_steps=24",
                                    "trainer.checkpoint_every=24"],
    }  # fmt: skip
    summaries = {}
    for name, args in runs.items():
        proc, _ = cli(args + [f"hydra.run.dir={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    extended = JOB + SLOW + ["sync.inner_time_s=0.016", f"hydra.run.dir={tmp_path / 'first_half'}"]
    proc, _ = cli(extended)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(tmp_path / "plain" / "model.pt", tmp_path / "on_time" / "model.pt")
    paced = summaries["paced"]
    assert paced["computed_steps"] == 48 and paced["idle_steps"] == 0  # rank 0: on time
    # syncs after steps 0, 8, ..., 40 (1 step, then 6 rounds of 8) and a final one of 7:
    # worker 3 trains 1, then 2 a round, 2 in the last
    batch = 32
    assert paced["round_weights"] == [7 * batch] * 3 + [2 * batch]
    assert paced["contributed_samples"] == batch * (4 + 5 * (3 * 8 + 2) + (3 * 7 + 2))
    # samples merged, counted once however many fragments averaged them: more than the three
    # fast workers' 48 steps, at most the whole fleet's
    fragments = summaries["fragments"]["contributed_samples"]
    assert 3 * 48 * batch < fragments <= 4 * 48 * batch, fragments
    assert not same_model(tmp_path / "plain" / "model.pt", tmp_path / "paced" / "model.pt")
    # the pacing is in the checkpoint, and the modelled clock repeats: an exact continuation
    assert same_model(tmp_path / "paced" / "model.pt", tmp_path / "first_half" / "model.pt")


@pytest.mark.slow
@pytest.mark.long  # 4 processes, FSDP2: `make test-long`
@pytest.mark.timeout(120)
def test_a_sharded_replica_group_computes_a_tick_only_where_all_its_ranks_would(tmp_path):
    """2 replica groups of 2 ranks; rank 3 three times slower, so its group computes 2 of a
    round's 8 steps (its rank 2 idles with it: a rank computing alone would leave FSDP's
    collectives waiting), the other group all 8, and the rounds weigh the groups 7:2 as the
    unsharded run weighs workers 0 and 3."""
    run = tmp_path / "run"
    args = (
        JOB
        + SLOW
        + [
            "sync.inner_time_s=0.016",
            "dist.shard_size=2",
            "dist.timeout_s=30",
            "sync.check_replicas=true",
            f"hydra.run.dir={run}",
        ]
    )
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["computed_steps"] == 48 and summary["idle_steps"] == 0  # rank 0
    assert summary["round_weights"] == [7 * 32, 2 * 32]
    assert summary["replica_checks"] > 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_paced_run_resumed_at_another_world_size_starts_a_new_round(tmp_path):
    """Stopped 3 ticks after the sync at step 16 (rank 0 trained 3 steps, rank 3 2), then
    continued by 2 workers: they start from the 4 models' mean, so each starts a round of its
    own. Its 4 ticks: worker 0 trains 4 steps, worker 1 (three times slower) 2; inheriting the
    old round would make them [224, 128]."""
    run = tmp_path / "run"
    args = JOB + ["sync.inner_time_s=0.016", "comm.simulate.step_s=0.002", f"hydra.run.dir={run}"]
    first = [a for a in args if a != "trainer.checkpoint_every=0"]
    proc, _ = cli(
        first + ["comm.simulate.worker_speed=[1,1,1,3]", "trainer.max_steps=20",
                 "trainer.checkpoint_every=20"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = cli(
        args + ["dist.world_size=2", "comm.simulate.worker_speed=[1,3]", "trainer.max_steps=24"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at another world size" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["round_weights"] == [4 * 32, 2 * 32]


@pytest.mark.parametrize(
    "extra, named",
    [
        (["sync.inner_time_s=0"], "sync.inner_time_s must be > 0 (seconds), or null, got 0"),
        (["comm.simulate.worker_speed=[1,3]"], "one factor per worker (4), got 2"),
        (["comm.simulate.worker_speed=[1,1,1,0.5]", "comm.simulate.step_s=0.1"], "factor >= 1"),
        (["comm.simulate.worker_speed=[1,1,1,3]"], "comm.simulate.step_s must be > 0"),
        (["comm.simulate.step_s=0.1"], "comm.simulate.step_s without comm.simulate.worker_spee"),
        (["sync.inner_time_s=1", "sync.score=true"], "scores like a free rider's"),
        (["sync.budget_merge=fednova"], "sync.budget_merge must be one of normalized, weighted"),
    ],
)
@pytest.mark.timeout(30)
def test_pacing_settings_that_cannot_hold_are_refused_in_one_line(extra, named, tmp_path, capsys):
    args = FAST + ["dist.world_size=4", "trainer.checkpoint_every=0"]
    line = refusal(args + extra + [f"hydra.run.dir={tmp_path}"], capsys)
    assert named in line, line

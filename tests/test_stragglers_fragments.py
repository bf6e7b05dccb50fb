"""Slow workers under Streaming DiLoCo: each fragment's blocking round weighs every worker by
the samples it trained on since that fragment's own last sync (`StreamingAverager._weigh`), the
time budget is spread over the period's fragment rounds (`build_pacer`), and equal weights leave
today's bits."""

from __future__ import annotations

import json

import pytest
import torch

from localsgd.averaging import StreamingAverager
from tests.helpers import FAST, cli, refusal, run_distributed, same_model

# samples each of 3 workers trains before the syncs after steps 0, 1 and 2 (fragments 0, 1, 0)
TRAINED = [[1.0, 2.0, 5.0], [3.0, 1.0, 1.0], [2.0, 2.0, 6.0]]
LR, MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov step


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def _move(model: torch.nn.Module, rank: int, step: int) -> None:
    with torch.no_grad():  # this worker's own inner steps
        g = torch.Generator().manual_seed(10 * rank + step)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def _streaming_worker(rank: int, world: int, modes: list[str], trained: list[list[float]]):
    """Per mode, three syncs of a 2-fragment averager (H = 2: fragment 0 after steps 0 and 2,
    fragment 1 after step 1); a mode is plain (unweighted), weighted or normalized."""
    torch.set_num_threads(1)
    return {mode: _three_syncs(rank, mode, trained) for mode in modes}


def _three_syncs(rank: int, mode: str, trained: list[list[float]]) -> dict:
    model = _model(rank)
    averager = StreamingAverager(2, module=model, fragments=2)  # anchored on rank 0's model
    averager.weighted = mode != "plain"
    averager.normalized = mode == "normalized"
    out: dict = {"anchor": [p.detach().clone() for p in model.parameters()], "syncs": []}
    samples = 0.0
    for step in range(3):
        _move(model, rank, step)
        samples += trained[step][rank]
        averager.samples_trained = samples
        before = [p.detach().clone() for p in model.parameters()]
        averager.maybe_average()
        out["syncs"].append(
            {
                "before": before,
                "after": [p.detach().clone() for p in model.parameters()],
                "round_weights": averager.round_weights,
            }
        )
    return out


def _outer_step(anchor: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A fragment's first Nesterov step: its momentum buffer is the pseudo-gradient."""
    return anchor - LR * (delta + MOMENTUM * delta)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_fragment_weighs_the_samples_since_its_own_last_sync():
    runs = run_distributed(_streaming_worker, 3, ["weighted", "normalized"], TRAINED, timeout_s=60)
    weighted, normalized = [r["weighted"] for r in runs], [r["normalized"] for r in runs]
    # fragment 0 (the first Linear) at step 0: what each trained before it; fragment 1 (the
    # second Linear) at step 1: everything since the start; fragment 0 at step 2: since step 0
    first, second = TRAINED[0], [a + b for a, b in zip(TRAINED[0], TRAINED[1], strict=True)]
    again = [b + c for b, c in zip(TRAINED[1], TRAINED[2], strict=True)]
    for r in weighted + normalized:
        assert [s["round_weights"] for s in r["syncs"]] == [first, second, again]
    for runs, step, weights, tensors in (
        (weighted, 0, first, (0, 1)),
        (weighted, 1, second, (2, 3)),
        (normalized, 0, first, (0, 1)),
        (normalized, 1, second, (2, 3)),
    ):
        total = sum(weights)
        for i in tensors:
            anchor = runs[0]["anchor"][i]
            changes = [anchor - r["syncs"][step]["before"][i] for r in runs]
            if runs is weighted:  # the samples-weighted mean pseudo-gradient
                delta = sum(w / total * d for w, d in zip(weights, changes, strict=True))
            else:  # each scaled to the round's most samples first: the sum x max / total
                delta = max(weights) / total * sum(changes)
            expected = _outer_step(anchor, delta)
            for r in runs:
                got = r["syncs"][step]["after"][i]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
                assert torch.equal(got, runs[0]["syncs"][step]["after"][i])
    # the other fragment is left as each worker holds it
    for r in weighted:
        for i in (2, 3):
            assert torch.equal(r["syncs"][0]["after"][i], r["syncs"][0]["before"][i])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_equal_fragment_weights_give_the_unweighted_rounds_bit_for_bit():
    equal = [[4.0] * 3] * 3
    runs = run_distributed(_streaming_worker, 3, ["plain", "weighted", "normalized"], equal,
                           timeout_s=60)  # fmt: skip
    for mode in ("weighted", "normalized"):
        for r in runs:
            for gs, ps in zip(r[mode]["syncs"], r["plain"]["syncs"], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(gs["after"], ps["after"], strict=True))


STREAMING = FAST + [
    "dist.world_size=4",
    "model.hidden=[64,64]",  # 3 linear layers: blocks 0 and 2 in fragment 0, block 1 in 1
    "sync=streaming_diloco",
    "sync.period=8",
    "sync.fragments=2",
    "sync.delay_steps=0",
    "sync.merge_alpha=0",
    "sync.warmup_steps=0",
    "trainer.max_steps=32",
    "comm.simulate.worker_speed=[1,1,1,3]",
    "comm.simulate.step_s=0.002",
    "sync.inner_time_s=0.016",  # a period's 8 steps at speed 1: 4 a fragment round
]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_cli_paces_streaming_fragments_and_resumes_exactly(tmp_path):
    """Fragment rounds every 4 steps, each with 4 steps' budget: worker 3 (three times slower)
    computes 1 of each round's 4 steps; a fragment weighs the 2 rounds since its last sync."""
    whole, half = tmp_path / "whole", tmp_path / "half"
    proc, _ = cli(STREAMING + ["sync.check_replicas=true", "trainer.checkpoint_every=0",
                               f"hydra.run.dir={whole}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["computed_steps"] == 32 and summary["replica_checks"] > 0
    # the final average after step 31 syncs fragment 0 (last synced after step 24: 7 ticks,
    # worker 3 computing 1 in each of its 2 rounds), then fragment 1 (after step 28: 3 ticks,
    # worker 3 computing 1), whose weights are the last
    assert summary["round_weights"] == [3 * 32] * 3 + [1 * 32]
    lines = (whole / "metrics.jsonl").read_text().splitlines()
    weights = [json.loads(line).get("round_weights") for line in lines]
    assert [8 * 32] * 3 + [2 * 32] in weights  # a period's 2 rounds: 8 ticks, 2 computed
    proc, _ = cli(STREAMING + ["trainer.max_steps=16", "trainer.checkpoint_every=16",
                               f"hydra.run.dir={half}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = cli(STREAMING + ["trainer.checkpoint_every=16", f"hydra.run.dir={half}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(whole / "model.pt", half / "model.pt")


@pytest.mark.parametrize(
    "extra, named",
    [
        (["sync.delay_steps=1"], "with sync.delay_steps (a delayed fragment"),
        (["sync.merge_alpha=0.5"], "with sync.merge_alpha"),
        (["sync.outer=none"], "with sync.outer (plain streaming sends the values"),
        (["ft=torchft"], "with ft=torchft and sync.fragments=2 is not built"),
    ],
)
@pytest.mark.timeout(30)
def test_fragment_pacing_that_cannot_hold_is_refused_in_one_line(extra, named, tmp_path, capsys):
    line = refusal(STREAMING + extra + [f"hydra.run.dir={tmp_path}"], capsys)
    assert named in line, line


def _robust_weighted_worker(rank: int, world: int) -> str:
    from localsgd.averaging.robust import Aggregate

    torch.set_num_threads(1)
    averager = StreamingAverager(2, module=_model(rank), fragments=2, aggregate=Aggregate("median"))
    averager.weighted = True
    averager.samples_trained = 1.0 + rank
    try:
        averager.maybe_average()
    except ValueError as e:
        return str(e)
    return "averaged"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_weighted_round_over_robust_fragments_is_refused_not_ignored():
    for said in run_distributed(_robust_weighted_worker, 2, timeout_s=60):
        assert "combines the contributions unweighted" in said


def _delayed_weighted_worker(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    averager = StreamingAverager(2, module=_model(rank), fragments=2, delay_steps=1)
    averager.weighted = True
    try:
        averager.maybe_average()
    except ValueError as e:
        return str(e)
    return "averaged"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_weighted_round_of_a_delayed_fragment_is_refused_not_ignored():
    for said in run_distributed(_delayed_weighted_worker, 2, timeout_s=60):
        assert "weighted rounds are the blocking fragment rounds" in said

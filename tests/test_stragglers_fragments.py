"""Slow workers under Streaming DiLoCo: each fragment's round, blocking or delayed, weighs
every worker by the samples it trained on since that fragment's values last started from the
global ones (`StreamingAverager._weigh`), the time budget is spread over the period's fragment
rounds (`build_pacer`), and equal weights leave today's bits."""

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
    fragment 1 after step 1)."""
    torch.set_num_threads(1)
    return {mode: _three_syncs(rank, mode, trained) for mode in modes}


def _three_syncs(rank: int, mode: str, trained: list[list[float]]) -> dict:
    """`mode`: plain, weighted or normalized, and "_delayed": each fragment launched after its
    step and merged a step later (τ = 1)."""
    model = _model(rank)
    delay = 1 if mode.endswith("_delayed") else 0
    wire = "int8" if "_int8" in mode else "float32"
    averager = StreamingAverager(2, module=model, fragments=2, delay_steps=delay,
                                 comm_dtype=wire, quant_block_size=8)  # fmt: skip
    averager.weighted = not mode.startswith("plain")  # anchored on rank 0's model
    averager.normalized = mode.startswith("normalized")
    out: dict = {"anchor": [p.detach().clone() for p in model.parameters()], "syncs": []}
    for step in range(3):
        _move(model, rank, step)
        averager.trained(trained[step][rank])
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


MODES = ["weighted", "normalized", "weighted_delayed", "normalized_delayed"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_each_fragment_weighs_the_samples_since_its_own_last_sync():
    low = "weighted_int8_delayed"  # the int8 messages gathered now, decoded at the merge
    runs = run_distributed(_streaming_worker, 3, [*MODES, low], TRAINED, timeout_s=60)
    by_mode = {mode: [r[mode] for r in runs] for mode in MODES}
    weighted = by_mode["weighted"]
    # fragment 0 (the first Linear) at step 0: what each trained before it; fragment 1 (the
    # second Linear) at step 1: everything since the start; fragment 0 at step 2: since step 0,
    # or delayed, since its merge after step 1 (the steps in flight were replaced)
    first, second = TRAINED[0], [a + b for a, b in zip(TRAINED[0], TRAINED[1], strict=True)]
    again = [b + c for b, c in zip(TRAINED[1], TRAINED[2], strict=True)]
    for mode, group in by_mode.items():
        third = TRAINED[2] if mode.endswith("_delayed") else again
        for r in group:
            assert [s["round_weights"] for s in r["syncs"]] == [first, second, third], mode
    cases = []
    for mode in MODES:  # (mode, the sync launching, the sync merging, weights, tensors)
        merge = 1 if mode.endswith("_delayed") else 0
        cases += [(mode, 0, merge, first, (0, 1)), (mode, 1, 1 + merge, second, (2, 3))]
    for mode, launch, merge, weights, tensors in cases:
        group, total = by_mode[mode], sum(weights)
        for i in tensors:
            anchor = group[0]["anchor"][i]
            changes = [anchor - r["syncs"][launch]["before"][i] for r in group]
            if mode.startswith("weighted"):  # the samples-weighted mean pseudo-gradient
                delta = sum(w / total * d for w, d in zip(weights, changes, strict=True))
            else:  # each scaled to the round's most samples first: the sum x max / total
                delta = max(weights) / total * sum(changes)
            expected = _outer_step(anchor, delta)
            for r in group:
                got = r["syncs"][merge]["after"][i]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
                assert torch.equal(got, group[0]["syncs"][merge]["after"][i])
    # the int8 wire, launched: each message decoded at the merge and scaled by its sender's
    # weight from the launch, within the wire's rounding of the formula, far from the plain mean
    group, total = [r[low] for r in runs], sum(first)
    for i in (0, 1):
        anchor = group[0]["anchor"][i]
        changes = [anchor - r["syncs"][0]["before"][i] for r in group]
        got = (anchor - group[0]["syncs"][1]["after"][i]) / (LR * (1 + MOMENTUM))
        mean = sum(w / total * d for w, d in zip(first, changes, strict=True))
        assert (got - mean).abs().max() < 0.02
        assert (got - sum(changes) / 3).abs().max() > 0.2
        assert all(torch.equal(r["syncs"][1]["after"][i], group[0]["syncs"][1]["after"][i])
                   for r in group)  # fmt: skip
    # the other fragment is left as each worker holds it
    for r in weighted:
        for i in (2, 3):
            assert torch.equal(r["syncs"][0]["after"][i], r["syncs"][0]["before"][i])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_equal_fragment_weights_give_the_unweighted_rounds_bit_for_bit():
    equal = [[4.0] * 3] * 3
    modes = ["plain", "plain_delayed", *MODES]
    runs = run_distributed(_streaming_worker, 3, modes, equal, timeout_s=60)
    for mode in MODES:
        plain = "plain_delayed" if mode.endswith("_delayed") else "plain"
        for r in runs:
            for gs, ps in zip(r[mode]["syncs"], r[plain]["syncs"], strict=True):
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
# blocking in `make test-long`: its rounds' formula and weights are tested above, in-process
@pytest.mark.parametrize("delay", [pytest.param(0, marks=pytest.mark.long), 1])
def test_the_cli_paces_streaming_fragments_and_resumes_exactly(delay, tmp_path):
    """Fragment rounds every 4 steps, each with 4 steps' budget: worker 3 (three times slower)
    computes 1 of each round's 4 steps. Blocking, a fragment weighs the 8 ticks since its last
    round; delayed by a step, the 7 since its merge."""
    job = STREAMING + [f"sync.delay_steps={delay}"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    proc, _ = cli(job + ["sync.check_replicas=true", "trainer.checkpoint_every=0",
                         f"hydra.run.dir={whole}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["computed_steps"] == 32 and summary["replica_checks"] > 0
    lines = (whole / "metrics.jsonl").read_text().splitlines()
    weights = [json.loads(line).get("round_weights") for line in lines]
    # worker 3 computes the first tick after each launch (of 4), so blocking 2 of a fragment's
    # 8; delayed, the one after its own launch trains while the round is in flight and is
    # replaced at the merge, so 1 of the 7 since
    expected = [[8 * 32] * 3 + [2 * 32], [7 * 32] * 3 + [1 * 32]][delay]
    assert expected in weights
    if not delay:
        # the final average after step 31 syncs fragment 0 (last synced after step 24), then
        # fragment 1 (after step 28: 3 ticks, worker 3 computing 1), whose weights are the last
        assert summary["round_weights"] == [3 * 32] * 3 + [1 * 32]
    proc, _ = cli(job + ["trainer.max_steps=16", "trainer.checkpoint_every=16",
                         f"hydra.run.dir={half}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, _ = cli(job + ["trainer.checkpoint_every=16", f"hydra.run.dir={half}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(whole / "model.pt", half / "model.pt")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_streaming_experiment_as_it_is_runs_a_weighted_budget(tmp_path):
    """+experiment=streaming_diloco's own merge (a step late, mixed half-half) with the
    samples-weighted merge: its anchors agree on every rank after every round."""
    run = tmp_path / "run"
    args = [a for a in STREAMING if not a.startswith(("sync=", "sync.delay", "sync.merge_alpha"))]
    proc, _ = cli(args + ["sync=streaming_diloco", "sync.period=8", "sync.budget_merge=weighted",
                          "sync.check_replicas=true", "trainer.checkpoint_every=0",
                          f"hydra.run.dir={run}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    weights = summary["round_weights"]
    assert summary["replica_checks"] > 0 and weights[3] < weights[0]


@pytest.mark.parametrize(
    "extra, named",
    [
        (["sync.merge_alpha=0.5"], "set sync.merge_alpha=0, or sync.budget_merge=weighted"),
    ],
)
@pytest.mark.timeout(30)
def test_fragment_pacing_that_cannot_hold_is_refused_in_one_line(extra, named, tmp_path, capsys):
    line = refusal(STREAMING + extra + [f"hydra.run.dir={tmp_path}"], capsys)
    assert named in line, line


def _unweighable_worker(rank: int, world: int) -> dict[str, str]:
    """What a weighted round says over robust fragments, and a normalized one over a delayed
    mixed merge."""
    from localsgd.averaging.trust.robust import Aggregate

    torch.set_num_threads(1)
    averagers = {
        "robust": StreamingAverager(2, module=_model(rank), fragments=2,
                                    aggregate=Aggregate("median")),
        "mixed": StreamingAverager(2, module=_model(rank), fragments=2, delay_steps=1,
                                   merge_alpha=0.5),
    }  # fmt: skip
    said = {}
    for name, averager in averagers.items():
        averager.weighted = True
        averager.normalized = name == "mixed"
        averager.trained(1.0 + rank)
        try:
            averager.maybe_average()
            said[name] = "averaged"
        except ValueError as e:
            said[name] = str(e)
    return said


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_weighted_rounds_the_core_cannot_weigh_are_refused_not_ignored():
    for said in run_distributed(_unweighable_worker, 2, timeout_s=60):
        assert "combines the contributions unweighted" in said["robust"]
        assert "normalized ones merge_alpha=0" in said["mixed"]

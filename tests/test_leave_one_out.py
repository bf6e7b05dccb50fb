"""The judge's check of a contribution judged bad alone against the round's aggregate
(`localsgd.averaging.trust.leave_one_out`, `LeaveOneOut.spared`): under plain local SGD at a
high learning rate each local model overshoots in its own direction, every change alone can
raise the held-out loss while their mean gains, and the paired test against the median
contribution used to exclude an honest worker (issue 47). The check spoiling the aggregate
(`spoilers`) is tested in tests/test_robust.py."""

from __future__ import annotations

import json

import pytest
import torch

from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge, TrustedRound
from tests.test_robust import _Gathers

# the loss of a model v on sample i: |v - (TARGET + noise_i)|^2, from the anchor v = 0
TARGET = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
NOISE = 0.1 * torch.randn(256, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _rounds(rows: list[list[float]], rounds: int = 3, rule: str = "mean") -> TrustedRound:
    flat = torch.zeros(3)

    def loss_at(round_):
        return (flat.double() - (TARGET + NOISE)).square().sum(1)

    judge = Judge(loss_at, 3, 0.5, 3.0, False, probation_rounds=0)
    trust = TrustedRound([flat], 4, [None], Aggregate(rule), judge)
    for round_ in range(rounds):
        flat.zero_()
        trust.run_([flat], [torch.zeros(3)], _Gathers(torch.tensor(rows)), [None], step=round_)
    return trust


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_an_overshooting_honest_change_is_kept_where_the_mean_gains(rule):
    """Four honest changes, each the target plus an overshoot of its own, the overshoots
    summing to zero: their mean is the target (a gain of 1.0). Alone, worker 0 raises the loss
    by 1.25 (the median contribution: by 0.06) on every sample: bad alone, 3 rounds running, and
    it was excluded at round 2. The others' mean, which gains 0.75, gains 1.0 with it: kept."""
    rows = [[1.0, 1.5, 0.0], [1.0, -0.5, 0.9], [1.0, -0.5, -0.9], [1.0, -0.5, 0.0]]
    trust = _rounds(rows, rule=rule)
    middle = sum(sorted(trust.scores)[1:3]) / 2
    assert trust.scores[0] < -1.2 and -0.1 < middle < 0
    assert trust.zs[0] > 30  # the paired test alone condemns it
    assert [e for e in trust.events if e["why"] == "bad"] == []
    assert trust.excluded == {}


def test_a_change_that_spoils_the_mean_is_still_bad_where_the_mean_gains():
    """The same kind of round, worker 0 now an attacker whose change drags the mean off the
    target. Alone, it and honest worker 1 (an overshoot) raise the loss, each worse than the
    median contribution (-0.63): both are bad alone. The mean of the two others gains 0.44,
    more than twice the median's gain, so each is held against it: with worker 0 it raises the
    loss (1.69 above the target's, on every sample): bad every round, excluded at round 2;
    with worker 1 it is the target: kept, and the aggregate is the honest workers' mean."""
    rows = [[1.0, -2.4, 0.0], [1.0, 1.5, 0.0], [1.0, -1.0, 0.0], [1.0, -0.5, 0.0]]
    trust = _rounds(rows)
    assert [(e["rank"], e["round"]) for e in trust.events if e["why"] == "bad"] == [
        (0, 0),
        (0, 1),
        (0, 2),
    ]
    assert trust.excluded == {0: 2}
    assert trust.zs[1] > 3 and trust.scores[1] < 0  # bad alone
    flat = torch.zeros(3)
    trust.run_([flat], [torch.zeros(3)], _Gathers(torch.tensor(rows)), [None], step=3)
    assert torch.allclose(flat, torch.tensor([1.0, 0.0, 0.0]))


def test_rounds_where_the_median_contribution_gains_as_much_as_the_mean_are_unchanged():
    """A free rider among honest changes that each help: the median contribution gains about
    what the mean does (0.985 against 0.94), no leave-one-out check is made, and the free rider
    is bad every round and excluded at round 2, as before the check existed."""
    rows = [[1.0, 0.1, 0.0], [0.0, 0.0, 0.0], [0.9, -0.1, 0.0], [1.1, 0.0, 0.0]]
    trust = _rounds(rows)
    assert [(e["rank"], e["round"]) for e in trust.events if e["why"] == "bad"] == [
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert trust.excluded == {1: 2}


@pytest.mark.long  # 1 CLI run of 4 workers, ~5 s on 2 cores: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_scoring_alone_excludes_no_honest_worker(tmp_path):
    """Issue 47's reproduction: the pair matrix's 64-step, 4-worker MNIST-1D job with
    `sync.score=true` on the test split (`data.val_fraction=0`) and no attacker. Worker 0 was
    judged bad at rounds 5, 6 and 7 (3.2, 3.1 and 4.8 standard errors worse than the median
    contribution alone, while the mean of the four gained 0.11, 0.05 and 0.09) and excluded at
    round 7; now no worker is judged bad or excluded."""
    from tests.helpers import cli

    args = [
        "data=mnist1d",
        "dist.world_size=4",
        "trainer.max_steps=64",
        "sync.warmup_steps=0",
        "sync.period=8",
        "logger=jsonl",
        "trainer.progress=false",
        "logger.plots=false",
        "sync.score=true",
        "data.val_fraction=0",
        f"hydra.run.dir={tmp_path}",
    ]
    proc, left = cli(args)
    assert not left
    assert proc.returncode == 0, proc.stderr[-2000:]
    trust = json.loads((tmp_path / "summary.json").read_text())["trust"]
    assert trust["trust_rounds"] == 9
    assert trust["excluded"] == {} and trust["judged_bad"] == []
    assert "excluded" not in proc.stdout + proc.stderr

"""The adaptive period (`sync.schedule=adaptive`) in asynchronous rounds
(`averaging.asynchronous.fleet_period`).

- the syncer's rule decides once per round's worth of contributions (workers x fragments), from
  the mean over the workers of each one's step-weighted loss (their median under a robust rule),
  and resumes from its state;
- a syncer whose answer changes a worker's period forgets that worker's announced next time
  (under the modelled clock the order of merges would otherwise depend on when the new
  announcement reaches it);
- from the CLI: every worker equally fast with a quorum of all and the synchronous outer step
  gives the synchronous run's model bit for bit, whole or in fragments, with the period moving
  both ways; a run killed after a checkpoint resumes to the uninterrupted run's model (long).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from localsgd.averaging.asynchronous.fleet_period import FleetPeriod
from localsgd.averaging.asynchronous.messages import SEND
from localsgd.averaging.asynchronous.service import SyncerService
from localsgd.averaging.asynchronous.syncer import Syncer
from localsgd.averaging.rounds.part import Slice
from localsgd.averaging.schedule import AdaptivePeriod
from tests.helpers import BASE, cli, killed_and_resumed
from tests.test_async_rounds import SAME, same_as_synchronous

pytestmark = pytest.mark.timeout(120)


def _fleet(workers=2, parts=1, robust=False, tolerance=0.0) -> FleetPeriod:
    return FleetPeriod(AdaptivePeriod(4, tolerance=tolerance), workers, parts, robust)


def test_it_decides_once_per_round_of_contributions_on_the_workers_mean_loss():
    fleet = _fleet()
    fleet.merged([(0, [3.0, 4], 1), (1, [1.0, 4], 1)])  # the first decision: a loss to beat
    assert (fleet.period, fleet.rule.last_loss, fleet.decisions) == (4, 2.0, 1)
    # worker 0 twice (a fast one), then worker 1 once: its two reports weigh by their steps
    fleet.merged([(0, [1.0, 1], 1)])
    assert fleet.decisions == 1  # one contribution of two: no decision yet
    fleet.merged([(0, [4.0, 3], 1)])
    assert fleet.decisions == 2 and fleet.rule.last_loss == 3.25  # (1 + 12) / 4, worker 1 none
    assert fleet.period == 2  # 3.25 did not fall below 2.0: k halves
    fleet.merged([(1, [0.5, 4], 1), (0, [0.5, 2], 1)])
    assert fleet.period == 4 and fleet.rule.last_loss == 0.5


def test_fragments_decide_once_per_cycle_and_a_non_finite_loss_is_not_read():
    fleet = _fleet(workers=2, parts=2)
    fleet.merged([(0, [2.0, 2], 1), (1, [2.0, 2], 1), (0, [math.nan, 2], 1)])
    assert fleet.decisions == 0
    fleet.merged([(1, [2.0, 2], 1)])
    assert fleet.decisions == 1 and fleet.rule.last_loss == 2.0


def test_a_robust_rule_takes_the_median_so_one_worker_cannot_set_the_period():
    reports = [(0, [1.0, 4], 1), (1, [1.1, 4], 1), (2, [1e9, 4], 1)]
    plain, robust = _fleet(workers=3), _fleet(workers=3, robust=True)
    plain.merged(reports)
    robust.merged(reports)
    assert robust.rule.last_loss == 1.1 and plain.rule.last_loss > 1e8


def test_its_state_resumes_mid_window():
    whole, first = _fleet(workers=3), _fleet(workers=3)
    rounds = [[(0, [2.0, 4], 1), (1, [2.0, 4], 1), (2, [2.0, 4], 1)],
              [(0, [1.0, 4], 1)], [(1, [1.5, 4], 1), (2, [0.5, 4], 1)]]  # fmt: skip
    for r in rounds:
        whole.merged(r)
    first.merged(rounds[0])
    first.merged(rounds[1])
    resumed = _fleet(workers=3)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed.merged(rounds[2])
    assert resumed.state_dict() == whole.state_dict() and whole.period == 8
    fresh = _fleet(workers=3)  # without the state: no loss to beat, no decision yet
    fresh.merged(rounds[2])
    assert fresh.period == 4


class _Box:
    def __init__(self):
        self.put_ = {}

    def put(self, key, value, ring=False):
        self.put_[key] = value


class _Links:
    sessions = False

    def __init__(self):
        self.boxes = [_Box()]

    def box(self, r):
        return self.boxes[r]


def test_an_answer_that_changes_the_period_makes_the_worker_announce_again():
    """A merge whose decision moves the period: the sender's next time, announced at the old
    period, is forgotten (the syncer waits for its new announcement); one whose period stands
    keeps it. In-process: one worker beside the syncer, its contributions in-process."""
    buffers = [torch.zeros(3)]
    syncer = Syncer(buffers, [[Slice(0, 0, 3, 3)]], {"lr": 1.0, "momentum": 0.0,
                    "nesterov": False, "warmup_rounds": 0}, period=_fleet(workers=1))  # fmt: skip
    links = _Links()
    service = SyncerService(syncer, links, 1, modelled=True, min_quorum=1, grace_s=0.0,
                            collective_rounds=False)  # fmt: skip
    answers = []
    for seq, loss, time in [(0, 2.0, 1.0), (1, 3.0, 2.0), (2, 1.0, 3.0)]:
        header = {"kind": SEND, "time": time, "next": time + 1, "samples": 4.0,
                  "fragments": [0], "weights": [4.0], "versions": list(syncer.versions),
                  "seq": seq, "loss": [loss, 4], "period": syncer.period.period}  # fmt: skip
        service.payload.put(([torch.ones(3)], None))  # rank 0's values, no senders' marks
        service._handle(time, {0: header})
        answers.append((links.boxes[0].put_[f"r/0/{seq}"]["period"], service.announced[0]))
    # the first loss is the one to beat; the second rose: k halves, its time forgotten;
    # the third fell: k doubles, forgotten again
    assert answers == [(4, 2.0), (2, None), (4, None)]
    assert syncer.version == 3
    # a message from before a time the syncer handled breaks the model's order: it says so
    late = {"kind": SEND, "time": 2.5, "next": 4.0}
    with pytest.raises(RuntimeError, match="came after the syncer had handled 3 s"):
        service._take_header(0, late)


def _equal_clocks(fragments: int, steps: int) -> list[str]:
    # no meetings but the end (a meeting merges everyone, where the synchronous rounds do not)
    args = [a for a in SAME if not a.startswith(("trainer.checkpoint_every", "trainer.max_steps",
                                                 "sync.period="))]  # fmt: skip
    return args + [f"trainer.max_steps={steps}", "sync.period=2", "trainer.checkpoint_every=1000",
                   "sync.schedule=adaptive", "sync.adaptive_tolerance=0.1", "sync.max_period=16",
                   f"sync.fragments={fragments}"]  # fmt: skip


@pytest.mark.slow
# k goes from 2 down to 1 and up to 16 (the synchronous rounds' own decisions); with fragments the
# run ends where a cycle ends, so that the final meeting, which sends both fragments, is where
# the synchronous rounds end theirs (elsewhere the ends differ under any schedule)
@pytest.mark.parametrize("fragments, steps", [(1, 60), (2, 51)])
def test_equal_clocks_with_an_adaptive_period_are_synchronous_diloco_bit_for_bit(
    tmp_path, fragments, steps
):
    summary = same_as_synchronous(tmp_path, _equal_clocks(fragments, steps))
    assert summary["async_period_decisions"] >= 5
    assert summary["async_exchanges"]["p2p"] == 0  # every round a synchronous one


@pytest.mark.slow
def test_a_meeting_does_not_count_towards_a_decision(tmp_path):
    """Checkpoints every 8 steps are meetings (after steps 7, 15 and the last, 23): each merges
    every worker, but only the phases' merges count towards the period's decisions, as only
    rounds do synchronously (a meeting's few steps would take a decision early)."""
    args = [a for a in _equal_clocks(1, 24) if not a.startswith("trainer.checkpoint_every")]
    args += ["sync.mode=async", "sync.min_quorum=4", "comm.simulate.worker_speed=[1,1,1,1]",
             "comm.simulate.step_s=0.001", "trainer.checkpoint_every=8",
             f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    meetings = 3
    assert summary["async_period_decisions"] == summary["async_merges"] - meetings >= 3


@pytest.mark.slow
@pytest.mark.long  # ~10 s: `make test-long`
def test_an_adaptive_asynchronous_run_resumes_exactly_after_a_kill(tmp_path):
    """One worker 3x slower: the syncer's rule (its loss to beat, its window's losses) comes
    back from the step-10 checkpoint; a rule counted afresh would decide other periods."""
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "sync.period=2",
                   "sync.schedule=adaptive", "sync.adaptive_tolerance=0.2",
                   "comm.simulate.worker_speed=[1,3]", "comm.simulate.step_s=0.002",
                   "sync.check_replicas=true"]  # fmt: skip
    reference, _ = killed_and_resumed(args, tmp_path)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["async_period_decisions"] >= 3 and summary["replica_checks"] >= 1

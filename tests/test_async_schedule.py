"""A step schedule (`sync.schedule=step`) in asynchronous rounds (`averaging.asynchronous.phases`).

- an asynchronous worker that computes every step ends its phases where the synchronous
  averagers run their rounds: `PeriodicAverager`'s rule for the whole model, Streaming
  DiLoCo's cycles for fragments; the grid's state resumes where it was;
- from the CLI: every worker equally fast with a quorum of all and the synchronous outer step
  gives the synchronous run's model bit for bit with the period doubling mid-run; a run killed
  after a checkpoint taken inside a cycle resumes to the uninterrupted run's model (long);
- the time budget with a step or adaptive schedule is refused in one line (the adaptive
  schedule itself: `test_async_adaptive.py`).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import PeriodicAverager, StreamingAverager
from localsgd.averaging.asynchronous.phases import PhaseGrid
from localsgd.averaging.schedule import ConstantPeriod, StepPeriod
from localsgd.averaging.virtual import run_virtual
from tests.helpers import BASE, killed_and_resumed, refusal
from tests.test_async_rounds import SAME, same_as_synchronous

pytestmark = pytest.mark.timeout(120)

WARMUP, STEPS = 3, 80
SCHEDULES = {
    "constant": lambda: ConstantPeriod(4),
    "step": lambda: StepPeriod(4, 2, [10, 30]),  # k = 4, then 8 from step 10, 16 from 30
    "step, odd milestones": lambda: StepPeriod(2, 3, [7, 21]),
}


def _synchronous_rounds(rank, baton):
    """The steps after which each synchronous averager runs a round (fragment p's, streaming),
    in a virtual world of one (in-process)."""
    dist.init_process_group("virtual", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _rounds()
    finally:
        dist.destroy_process_group()


def _rounds() -> dict:
    out = {}
    for name, schedule in SCHEDULES.items():
        model = torch.nn.Linear(4, 4)
        periodic = PeriodicAverager(
            schedule().period, WARMUP, module=model, schedule=schedule(), init_sync=True
        )
        out[name, 1] = [s for s in range(STEPS) if periodic.maybe_average()]
        streaming = StreamingAverager(
            schedule().period, WARMUP, module=torch.nn.Sequential(model, torch.nn.Linear(4, 4)),
            fragments=2, schedule=schedule(),
        )  # fmt: skip
        out[name, 2] = [s for s in range(STEPS) if streaming.maybe_average()]
    return out


@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_phases_end_where_the_synchronous_rounds_run(name, fragments):
    want = run_virtual(_synchronous_rounds, 1, timeout_s=60)[0][name, fragments]
    grid = PhaseGrid(SCHEDULES[name](), fragments, WARMUP)
    got = [s for s in range(WARMUP, STEPS) if grid.ends(s - WARMUP + 1, s)]
    assert got == want
    gaps = {b - a for a, b in zip(got, got[1:], strict=False)}
    assert len(gaps) > 1 if name != "constant" else gaps == {4 // fragments}


def test_the_grid_resumes_mid_cycle():
    """A checkpoint mid-cycle (a meeting's) resumes the phases' ends where they were."""
    whole = PhaseGrid(StepPeriod(2, 3, [6]), 2, 0)
    ends = [s for s in range(40) if whole.ends(s + 1, s)]
    first = PhaseGrid(StepPeriod(2, 3, [6]), 2, 0)
    before = [s for s in range(15) if first.ends(s + 1, s)]
    resumed = PhaseGrid(StepPeriod(2, 3, [6]), 2, 0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + [s for s in range(15, 40) if resumed.ends(s + 1, s)] == ends
    # without the saved state the resumed worker would count its cycles from the start
    fresh = PhaseGrid(StepPeriod(2, 3, [6]), 2, 0)
    assert before + [s for s in range(15, 40) if fresh.ends(s + 1, s)] != ends


@pytest.mark.slow
def test_equal_clocks_with_a_step_schedule_are_synchronous_diloco_bit_for_bit(tmp_path):
    # rounds after steps 3 and 7 (k = 4), then, k = 8 from step 8 on, after 15 and 23: where
    # the meetings (checkpoints after 8, 16 and 24 steps) fall, since a meeting merges everyone
    args = SAME + ["sync.schedule=step", "sync.period_milestones=[8]"]
    summary = same_as_synchronous(tmp_path, args)
    assert summary["async_merges"] == 4  # a constant k = 4 merges 6 times
    assert summary["async_exchanges"]["collective"] == 4


@pytest.mark.slow
@pytest.mark.long  # ~10 s: `make test-long`
def test_a_step_scheduled_asynchronous_run_resumes_exactly_after_a_kill(tmp_path):
    """2 fragments, k = 2 then 6 from step 10, 2 equally fast workers (so that their steps are
    the ticks): the kill comes after the step-10 checkpoint, taken inside a cycle of k = 2 that
    started before the milestone; the resumed run (its phases' grid from the checkpoint) ends on
    the uninterrupted run's model. A grid counted afresh there would end its phases at steps 11,
    14, ... instead of 10, 13, ...: another model."""
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "sync.period=2", "sync.fragments=2",
                   "sync.schedule=step", "sync.period_factor=3", "sync.period_milestones=[10]",
                   "comm.simulate.worker_speed=[1,1]", "comm.simulate.step_s=0.002",
                   "sync.check_replicas=true"]  # fmt: skip
    reference, _ = killed_and_resumed(args, tmp_path)
    assert json.loads((reference / "summary.json").read_text())["replica_checks"] >= 1


@pytest.mark.parametrize(
    "args, names",
    [
        (
            ["sync.inner_time_s=0.1", "sync.schedule=step"],
            "sync.schedule=step or adaptive and sync.inner_time_s",
        ),
        (
            ["sync.inner_time_s=0.1", "sync.schedule=adaptive"],
            "sync.schedule=step or adaptive and sync.inner_time_s",
        ),
    ],
)
def test_a_schedule_asynchronous_rounds_cannot_follow_is_one_line(args, names, capsys):
    line = refusal(["sync.outer=diloco", "sync.mode=async"] + args, capsys)
    assert names in line

"""Where an asynchronous worker's inner phase ends when it is counted in steps: the rule of the
synchronous rounds the same config would run, applied to the steps this worker computed.

- A constant period k (`sync.schedule=constant`) with P fragments: a phase after the first
  computed step, then every k / P steps (torch's rule, as `PeriodicAverager` and Streaming
  DiLoCo's staggered fragments).
- A varying period (`sync.schedule=step`, `StepPeriod`) without fragments: a phase ends once
  `period_at(step)` steps have passed since the last one ended, `PeriodicAverager`'s rule for a
  varying period; with P fragments the steps come in cycles, each as long as the schedule's
  period at its start rounded up to a multiple of P, a phase every cycle / P steps, Streaming
  DiLoCo's rule (`StreamingAverager.launching`).

So a fleet of equally fast workers ends its phases at the steps where the synchronous rounds
run theirs. `step` is the worker's step (the schedule's milestones are steps, as the learning
rate's); `done` counts the steps it computed, one on the first step after the warmup.
"""

from __future__ import annotations

import copy

from localsgd.averaging.schedule import ConstantPeriod, cycle_length


class PhaseGrid:
    """The phases' ends for a `schedule` (a `ConstantPeriod` or a `StepPeriod`) and
    `fragments`. `ends(done, step)` is asked once per computed step, in order."""

    def __init__(self, schedule: ConstantPeriod, fragments: int, first_step: int):
        self.schedule, self.fragments = schedule, fragments
        self.last: int | None = None  # varying, whole model: the `done` of the last phase end
        self.start = 1  # the cycle's first computed step
        self.length = self._cycle(first_step)

    def _cycle(self, step: int) -> int:
        return cycle_length(self.schedule, step, self.fragments)

    def ends(self, done: int, step: int) -> bool:
        if self.schedule.varies and self.fragments == 1:
            if self.last is None or done - self.last >= self.schedule.period_at(step):
                self.last = done
                return True
            return False
        while done >= self.start + self.length:  # the next cycle, at the schedule's period now
            self.start, self.length = self.start + self.length, self._cycle(step)
        return (done - self.start) % (self.length // self.fragments) == 0

    def restart(self, done: int, step: int) -> None:
        """A phase ended at `done` off the grid (aligned to the others): count from there."""
        self.last, self.start, self.length = done, done, self._cycle(step)

    def copy(self) -> PhaseGrid:
        return copy.copy(self)

    def state_dict(self) -> dict:
        return {"last": self.last, "start": self.start, "length": self.length}

    def load_state_dict(self, state: dict) -> None:
        self.last, self.start = state["last"], int(state["start"])
        self.length = int(state["length"])

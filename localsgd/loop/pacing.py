"""Slow workers: per-worker step counts in a time budget, and a deterministic model of a slow
worker to test them with.

Every worker runs the same step indices ("ticks"), so syncs, evaluations, checkpoints and the
learning-rate schedule stay where they are. A tick either computes a step or idles:

- `sync.inner_time_s` = T: a worker computes a tick's step only while its time in this round
  (since the end of the last sync), plus what the step will take, fits in T; it idles the
  round's other ticks. A slow worker then does fewer steps instead of holding up the others,
  which arrive at the sync after about T (Async Local-SGD's DyLU: steps in proportion to speed),
  and the average weighs each worker by the samples it trained on this round
  (`Averager.weighted`), each change first scaled to the round's most samples
  (`sync.budget_merge=normalized`, `Averager.normalized`). With every worker on time nobody
  idles, every weight is equal and the average is the plain mean, bit for bit.
- `comm.simulate.worker_speed` = [s_0, s_1, ...] with `comm.simulate.step_s` = t: worker r's
  step takes s_r * t seconds (it sleeps out what its compute did not take), as the link
  simulation makes each collective last what its bytes would. The time in a round is then the
  modelled one, s_r * t per computed step, so which ticks compute is the same on every run and
  machine; without `sync.inner_time_s` every tick computes and the others wait for the slow
  worker at each sync (the blocking path, to measure against).

Without a model the time is the wall clock's, a step's predicted length the mean of the last
ones, and which ticks compute depends on the machine's load: such a run resumes from its
checkpoints, but is not repeatable bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

# the modelled clock sums floats: a round of exactly T seconds of steps still fits
_FITS = 1 + 1e-9


class Pacer:
    """Whether each tick computes, and what this worker trained on since the last sync."""

    def __init__(
        self,
        inner_time_s: float | None = None,
        speed: float = 1.0,
        step_s: float | None = None,
        sleeps: bool = True,
        rule=None,
    ):
        self.budget = inner_time_s  # None: every tick computes
        self.speed = speed
        self.step_s = step_s  # None: the wall clock
        # modelled: a step sleeps out what its compute did not take (so the others wait as
        # they would); virtual workers take turns on one clock, where nobody waits: no sleep
        self.sleeps = sleeps
        # asynchronous rounds' modelled clock (`localsgd.averaging.asynchronous.clock`): the
        # averager's word on each tick, `Synchroniser.computes`
        self.rule = rule
        self.round_seconds = 0.0  # modelled (or measured) seconds computed in this round
        self.round_samples = 0  # samples trained on in this round: the average's weight
        self.samples = 0  # ... and in every round (a fragment weighs what it gained since its sync)
        self.computed_steps = 0
        self.idle_steps = 0
        self.predicted: float | None = None  # wall clock: a step's predicted seconds
        self.round_start = time.perf_counter()
        self.step_start = 0.0

    @property
    def modelled(self) -> bool:
        return self.step_s is not None

    @property
    def active(self) -> bool:
        """Whether it does anything (a budget or a modelled speed)."""
        return self.budget is not None or self.modelled

    def computes(self) -> bool:
        """Whether the next tick computes its step (asked once per tick past the warmup): under
        asynchronous rounds' modelled clock where this worker's step ends by the tick; else
        always without a budget, or while this round's time, plus the step's, fits in it."""
        if self.rule is not None and self.modelled:
            return self.rule()
        if self.budget is None:
            return True
        if self.modelled:
            return self.round_seconds + self.speed * self.step_s <= self.budget * _FITS
        spent = time.perf_counter() - self.round_start
        return spent + (self.predicted or 0.0) <= self.budget

    def begin_step(self) -> None:
        self.step_start = time.perf_counter()

    def end_step(self, samples: int) -> None:
        """A computed step of `samples` samples ended: modelled, it lasts speed * step_s (the
        rest slept out)."""
        took = time.perf_counter() - self.step_start
        if self.modelled:
            modelled = self.speed * self.step_s
            if modelled > took and self.sleeps:
                time.sleep(modelled - took)
            took = modelled
        else:
            self.predicted = took if self.predicted is None else 0.5 * (self.predicted + took)
        self.round_seconds += took
        self.round_samples += samples
        self.samples += samples
        self.computed_steps += 1

    def idle(self) -> None:
        self.idle_steps += 1

    def new_round(self) -> None:
        """The workers synced: the next round's time and samples start from zero."""
        self.round_seconds = 0.0
        self.round_samples = 0
        self.round_start = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return {
            "round_seconds": self.round_seconds,
            "round_samples": self.round_samples,
            "samples": self.samples,
            "computed_steps": self.computed_steps,
            "idle_steps": self.idle_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round_seconds = float(state["round_seconds"])
        self.round_samples = int(state["round_samples"])
        self.samples = int(state.get("samples", 0))
        self.computed_steps = int(state["computed_steps"])
        self.idle_steps = int(state["idle_steps"])
        self.round_start = time.perf_counter() - (0.0 if self.modelled else self.round_seconds)

    @staticmethod
    def resharded_state(states: list[dict[str, Any]], reshard) -> dict[str, Any]:
        """This worker's pacer state at another world size (`localsgd.loop.checkpoint.state`):
        its rank's counts (the last old rank's for a new one), with its round started afresh:
        every worker starts from one model, which is where a round starts."""
        state = states[min(reshard.rank, len(states) - 1)]
        return {**state, "round_seconds": 0.0, "round_samples": 0}


def build_pacer(cfg: Any, rank: int, rule=None) -> Pacer:
    """The `sync.inner_time_s` / `comm.simulate.worker_speed` pacing of worker `rank`. Streaming
    DiLoCo's P fragments sync in turn, every period / P steps: each of those rounds gets 1/P
    of the budget, a period's P rounds the whole of it. `rule()`: under asynchronous rounds,
    whether the averager's modelled clock computes the next tick (`Synchroniser.computes`)."""
    sim = cfg.comm.simulate
    speeds = sim.worker_speed
    budget = cfg.sync.inner_time_s
    asynchronous = cfg.sync.mode == "async"
    if asynchronous:  # nobody waits: a phase's budget is the averager's rule
        budget = None
    if budget is not None:
        budget /= cfg.sync.fragments
    return Pacer(
        budget,
        float(speeds[rank]) if speeds else 1.0,
        sim.step_s if speeds else None,
        sleeps=cfg.dist.virtual_workers is None,
        rule=rule if asynchronous else None,
    )


def pace_record(pacer: Pacer) -> dict[str, Any]:
    """For the metrics and the summary, with pacing: this rank's computed and idle ticks (a
    weighted round's weights are the Synchroniser's record). Nothing without."""
    if not pacer.active:
        return {}
    return {"computed_steps": pacer.computed_steps, "idle_steps": pacer.idle_steps}

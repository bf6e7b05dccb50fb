"""The modelled clock of asynchronous rounds: which steps a slow worker computes.

Every worker runs the same step indices ("ticks"); tick k ends at k + 1 modelled steps of a
speed-1 worker (`comm.simulate.step_s` each). A worker of speed s (its step lasts s x step_s)
computes a tick only where its next step, started at its clock, ends by then, and idles the
others: a worker 3x slower computes every third tick, and one that waited for the syncer
(`sync.grace_s`) or at a meeting idles until the ticks catch up with its clock. So all the
workers cover the same modelled time, each doing the steps its speed allows (a slower machine
trains fewer samples in the same hours), rather than the fast ones finishing early and waiting
for the slow one. With every speed equal every tick computes. The trainer's pacer
(`localsgd.loop.pacing`, through `Synchroniser.computes`) and `AsyncAverager` read this rule.
"""

from __future__ import annotations

FITS = 1 + 1e-9  # modelled seconds are summed floats: a step ending exactly at the tick fits


def computes(clock: float, tick: int, step_seconds: float, step_s: float) -> bool:
    """Whether a worker whose modelled clock reads `clock` (seconds since the synchronous
    warmup) and whose step lasts `step_seconds` computes tick `tick` (counted from 0 after the
    warmup), which ends at (tick + 1) x `step_s`."""
    return clock + step_seconds <= (tick + 1) * step_s * FITS


def instant(seconds: float) -> float:
    """A modelled time as messages carry it: rounded to the nanosecond, so that two workers'
    sums of step lengths that meet (50 steps of 0.015 s, 25 of 0.03 s) are one instant, as
    the model means, not two that differ in their last bits."""
    return round(seconds, 9)

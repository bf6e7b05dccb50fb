"""The modelled clock of asynchronous rounds: which steps a slow worker computes.

Every worker runs the same step indices ("ticks"); tick k ends at k + 1 modelled steps of a
speed-1 worker (`comm.simulate.step_s` each). A worker of speed s (its step lasts s x step_s)
computes a tick only where its next step ends by then, and idles the others: a worker 3x slower
computes every third tick. So all the workers cover the same modelled time, each doing the
steps its speed allows (a slower machine trains fewer samples in the same hours), rather than the
fast ones finishing early and waiting for the slow one. With every speed equal every tick
computes. The trainer's pacer (`localsgd.loop.pacing`) and `AsyncAverager` read this one rule.
"""

from __future__ import annotations

FITS = 1 + 1e-9  # modelled seconds are summed floats: a step ending exactly at the tick fits


def computes(done: int, tick: int, speed: float) -> bool:
    """Whether a worker of `speed` that computed `done` of the ticks before `tick` (counted
    from 0 after the synchronous warmup) computes tick `tick`."""
    return (done + 1) * speed <= (tick + 1) * FITS

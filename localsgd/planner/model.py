"""The utilisation model: a round's exposed communication from bytes, the link and the step time.

A *round* is one period of H steps (H = 1: a gradient all-reduce every step, DDP). In it each of
the P fragments (P = 1: the whole model) is sent once, in one collective of `b_p` bytes (one
worker's payload, what `Communicator` counts and `comm.simulate` charges), which the link
carries in

    S_p = L + 8 b_p / B                     (L latency, B bandwidth in bit/s)

(blocking collectives of several pieces, one per flat buffer, pay L once per piece; a launched
set pays it once). A collective launched τ steps before its merge (`sync.delay_steps`, the
delayed merge of `sync.overlap`) runs while those τ steps compute, so what is left of it at the
merge is

    e_p = max(0, S_p - τ c)                 (c: the step time of the slowest worker)

Every worker leaves a blocking collective (or a merge) together, so the job moves at its slowest
worker's pace: a round lasts

    T = H c_max + sum_p e_p

and worker w, computing H c_w of it, is utilised u_w = H c_w / T. The slowest worker waits only
for the link; a faster one also waits H (c_max - c_w) a round for the slowest (the barrier).
`comm.simulate.worker_speed` makes worker r's step s_r times `comm.simulate.step_s`, so there
c_w = s_w x step_s.

What it leaves out (each costs wall time the model does not see): the outer step and the merge,
encoding and decoding a quantised or top-k message beyond what the link's time covers, a real
transport slower than `comm.simulate`'s (the simulated link sleeps only what the real collective
did not take), per-step jitter between the workers (the barrier above uses mean step times),
logging, evaluation and checkpoints. docs/performance.md (`#predicting-utilisation`) has the
model worked by hand and its check against measurement (experiments/plan_check/).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """What a collective costs: `latency_s` each, and its payload at `bandwidth_gbps` (None:
    unlimited); an all-gather (a quantised or top-k wire) at `gather_gbps` (None: the same).
    `simulated`: `comm.simulate`'s link, which times each worker's collective from that
    worker's own start; a network's transfer starts when the last worker has joined."""

    latency_s: float
    bandwidth_gbps: float | None = None
    gather_gbps: float | None = None
    simulated: bool = False

    def seconds(self, nbytes: int, gather: bool = False, pieces: int = 1) -> float:
        """How long one collective of `nbytes` per worker takes, in `pieces` blocking parts."""
        gbps = self.gather_gbps if gather and self.gather_gbps is not None else self.bandwidth_gbps
        transfer = 0.0 if gbps is None else nbytes * 8 / (gbps * 1e9)
        return pieces * self.latency_s + transfer

    def describe(self) -> str:
        rate = "unlimited" if self.bandwidth_gbps is None else f"{self.bandwidth_gbps:.3g} Gbit/s"
        text = f"{rate}, {self.latency_s * 1e3:.3g} ms latency"
        if self.gather_gbps is not None and self.gather_gbps != self.bandwidth_gbps:
            text += f" (all-gathers {self.gather_gbps:.3g} Gbit/s)"
        return text


@dataclass(frozen=True)
class Schedule:
    """What a setting sends: every `period` steps each fragment once, `fragment_bytes[p]` bytes
    (one worker's payload), merged `delay` steps after its launch; `gather`: the wire is
    all-gathered (quantised, top-k); `pieces`: blocking collectives per sync (one per flat
    buffer); `warmup`: synchronous steps before the first sync (a sync's step counts from it)."""

    period: int
    fragment_bytes: tuple[int, ...]
    delay: int = 0
    gather: bool = False
    pieces: int = 1
    warmup: int = 0

    @property
    def fragments(self) -> int:
        return len(self.fragment_bytes)

    @property
    def round_bytes(self) -> int:
        return sum(self.fragment_bytes)

    def link_seconds(self, link: Link, p: int) -> float:
        """S_p: fragment p's collective on `link`."""
        pieces = 1 if self.delay > 0 else self.pieces  # a launched set pays the latency once
        return link.seconds(self.fragment_bytes[p], self.gather, pieces)

    def exposed(self, link: Link, p: int, step_s: float) -> float:
        """e_p = max(0, S_p - τ c): what fragment p's sync adds to the wall time."""
        return max(0.0, self.link_seconds(link, p) - self.delay * step_s)


@dataclass(frozen=True)
class Prediction:
    utilisation: list[float]  # per worker, u_w = H c_w / T
    round_s: float  # T
    exposed_s: float  # sum_p e_p: the link's share of a round
    barrier_s: list[float]  # per worker, H (c_max - c_w): waiting for the slowest
    bytes_per_param_step: float

    @property
    def mean_utilisation(self) -> float:
        """The job's: its workers' compute over their wall time, averaged."""
        return sum(self.utilisation) / len(self.utilisation)


def predict(schedule: Schedule, link: Link, step_s: list[float], params: int) -> Prediction:
    """Steady state, one round (see the module doc); `step_s`: each worker's step time."""
    slowest = max(step_s)
    exposed = sum(schedule.exposed(link, p, slowest) for p in range(schedule.fragments))
    round_s = schedule.period * slowest + exposed
    return Prediction(
        utilisation=[schedule.period * c / round_s for c in step_s],
        round_s=round_s,
        exposed_s=exposed,
        barrier_s=[schedule.period * (slowest - c) for c in step_s],
        bytes_per_param_step=schedule.round_bytes / (schedule.period * params),
    )


def sync_steps(schedule: Schedule, steps: int) -> list[tuple[int, int, int]]:
    """(fragment, launch step, merge step) of every sync a run of `steps` steps makes in its
    training loop, as the averagers schedule them: fragment p is launched after step s when
    s >= warmup and (s - warmup) % H == p H / P, merged after step s + τ. H = 1 with one
    fragment is a sync after every step."""
    h, frags = schedule.period, schedule.fragments
    out = []
    for p in range(frags):
        s = schedule.warmup + p * h // frags
        while s < steps:
            out.append((p, s, s + schedule.delay))
            s += h
    return sorted(out, key=lambda e: (e[2], e[0]))


def run_clocks(schedule: Schedule, link: Link, step_times: list[list[float]]) -> list[float]:
    """Each worker's training-loop seconds for a run whose worker w takes `step_times[w][s]`
    on step s: the round formula applied sync by sync, each worker on its own clock. At a
    sync's merge a worker leaves `S_p` after the last worker launched it (a network), or, on
    `comm.simulate`'s link (`link.simulated`), when every worker has launched it and `S_p`
    since its own launch has passed (the link sleeps what is left of `S_p` from each worker's
    start, so a fast worker's wait for the slowest overlaps its `S_p`); never before the
    merge's step is computed. The steps after the last merge in the loop wait for nobody."""
    steps = len(step_times[0])
    clocks = [0.0] * len(step_times)
    events: dict[int, list[tuple[int, int, int]]] = {}
    for p, launch, merge in sync_steps(schedule, steps):
        events.setdefault(launch, []).append((p, launch, merge))
        if merge != launch:
            events.setdefault(merge, []).append((p, launch, merge))
    launched: dict[tuple[int, int], list[float]] = {}
    for s in range(steps):
        clocks = [t + times[s] for t, times in zip(clocks, step_times, strict=True)]
        # on one step the merge of the fragment in flight comes before the next launch
        for p, launch, merge in sorted(events.get(s, []), key=lambda e: e[1] == s):
            if launch == s:
                launched[(p, s)] = list(clocks)
            if merge == s:
                starts = launched.pop((p, launch))
                link_s = schedule.link_seconds(link, p)
                last = max(starts)
                if link.simulated:  # the sleep counts from each worker's own start
                    ends = [max(last, start + link_s) for start in starts]
                else:  # the transfer starts when the last worker has joined
                    ends = [last + link_s] * len(starts)
                clocks = [max(t, end) for t, end in zip(clocks, ends, strict=True)]
    return clocks


def predict_run(
    schedule: Schedule,
    link: Link,
    step_s: list[float],
    steps: int,
    samples: list[list[float]] | None = None,
    reps: int = 64,
    seed: int = 0,
) -> tuple[list[float], list[float]]:
    """A training loop of `steps` steps (`run_clocks`): each worker's utilisation (compute
    seconds over loop seconds) and loop seconds. Every step of worker w takes `step_s[w]`; or,
    with `samples` (worker w's measured step times), the barrier's jitter too: each of `reps`
    runs draws every step's time at random from the worker's samples (seeded), and the means
    over the runs are returned. The slowest worker of each round is then whoever was slowest
    in it, not the one slowest on average."""
    if samples is None:
        clocks = run_clocks(schedule, link, [[c] * steps for c in step_s])
        return [steps * c / t for c, t in zip(step_s, clocks, strict=True)], clocks
    rng = random.Random(seed)
    util = [0.0] * len(samples)
    walls = [0.0] * len(samples)
    for _ in range(reps):
        draws = [rng.choices(times, k=steps) for times in samples]
        clocks = run_clocks(schedule, link, draws)
        for w, (times, t) in enumerate(zip(draws, clocks, strict=True)):
            util[w] += sum(times) / t / reps
            walls[w] += t / reps
    return util, walls

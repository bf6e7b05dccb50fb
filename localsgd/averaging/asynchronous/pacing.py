"""The syncer's wall-clock pacing (`Pacing`): from each worker's arrivals, whether a merge waits
for a worker, and where a worker out of step with the others should end its next phase; and the
step length a worker reports for the adaptive grace window (`typical_step`). Under the modelled
clock none applies: the order and the steps are the model's (`service`)."""

from __future__ import annotations

from collections.abc import Callable


class Pacing:
    """Each worker's last arrival and the interval before it (`arrived`), read by `due` and
    `align`. `grace_s`: the syncer's grace window (seconds, or a callable giving the window as
    it stands: the adaptive one); `modelled`: the modelled clock (then `due` is the service's
    and none is realigned)."""

    def __init__(self, grace_s: float | Callable[[], float], modelled: bool):
        self.window = grace_s if callable(grace_s) else (lambda: grace_s)
        self.modelled = modelled
        self.arrivals: dict[int, tuple[float, float | None]] = {}
        self.aligned: dict[int, float] = {}  # the interval a worker told to align goes on at

    @property
    def grace_s(self) -> float:
        return self.window()

    @grace_s.setter
    def grace_s(self, seconds: float) -> None:
        self.window = lambda: seconds

    def arrived(self, r: int, now: float) -> None:
        """Worker r's contribution arrived at `now`."""
        last = self.arrivals.get(r)
        # after an aligned phase the worker goes on at the others' interval
        gap = self.aligned.pop(r, None) or (None if last is None else now - last[0])
        self.arrivals[r] = (now, gap)

    def due(self, r: int, oldest: float) -> bool:
        """Whether a merge whose oldest contribution arrived at `oldest` waits (at most
        `grace_s`) for worker r: under the modelled clock always; on the wall clock only where
        r's next contribution is due within the window around it (its last arrival plus its
        last interval), so that a worker out of step with the others (back from a freeze or a
        restart) or overdue (frozen, dead) does not hold every merge for the whole window."""
        if self.modelled or self.arrivals.get(r, (None, None))[1] is None:
            return True
        last, gap = self.arrivals[r]
        return oldest - self.grace_s <= last + gap <= oldest + self.grace_s

    def align(self, r: int, at: float, live: Callable[[int], bool]) -> float | None:
        """On the wall clock with a grace window: where worker r is out of step with most of
        the others still `live` (back from a freeze, a partition or a restart), the seconds
        from `at` to their next merge, when its next phase should end instead (earlier or
        later), so that its contributions are merged with theirs again; None where it is in
        step."""
        if self.modelled or self.grace_s <= 0 or self.arrivals.get(r, (0, None))[1] is None:
            return None
        others = [
            (last, gap) for w, (last, gap) in self.arrivals.items() if w != r and gap and live(w)
        ]
        if not others:
            return None
        dues = [last + gap for last, gap in others]
        # the due time most of them share (within the window): their next merge
        target = max(dues, key=lambda t: (sum(abs(u - t) <= self.grace_s for u in dues), -t))
        last, gap = self.arrivals[r]
        if abs(last + gap - target) <= self.grace_s:
            return None  # in step
        period = sorted(g for _, g in others)[len(others) // 2]
        while target < at + 0.5 * period:  # their next merge after this phase's start
            target += period
        # due then (a merge waits for it), and at their interval after
        self.arrivals[r], self.aligned[r] = (last, target - last), period
        return target - at


def typical_step(means) -> float | None:
    """A worker's step length for the adaptive grace window, on the wall clock: the median of
    its last phases' mean steps (`means`), so that one phase with a freeze or a partition in it
    does not widen every merge's window; None before its first phase."""
    ordered = sorted(means)
    return ordered[len(ordered) // 2] if ordered else None

"""Weighted rounds' weights: the samples each rank trained on since a part's values last started
from the global ones (`Averager.weighted`; the module doc of `localsgd.averaging.averager`)."""

from __future__ import annotations

__all__ = ["PartSamples"]


class PartSamples:
    """Per level and part, the samples this rank trained on since the part's values last started
    afresh at that level or a wider one: a weighted round's weight (see the module doc)."""

    def __init__(self, parts: int, progress: bool, levels: int = 1):
        self.since = [[0.0] * parts for _ in range(levels)]
        self.progress = progress  # a launched round's merge keeps what trained meanwhile

    def trained(self, samples: float) -> None:
        self.since = [[n + samples for n in row] for row in self.since]

    def restart(self) -> None:
        """Every part starts here (each step of a synchronous warmup, a resume at another world
        size)."""
        self.since = [[0.0] * len(row) for row in self.since]

    def weight(self, level: int, p: int, launched: bool) -> float:
        """Part p's weight in a round at `level`; the round restarts the counts of its level
        and the narrower ones (their values start from its result), a launched one at its
        merge unless the merge keeps the progress."""
        own = self.since[level][p]
        if not launched or self.progress:
            self._restart(level, p)
        return own

    def merged(self, level: int, p: int) -> None:
        """Part p's launched round merged, replacing (or, at alpha > 0, mostly replacing) what
        trained while it was in flight."""
        if not self.progress:
            self._restart(level, p)

    def _restart(self, level: int, p: int) -> None:
        for row in self.since[: level + 1]:
            row[p] = 0.0

    def state_dict(self) -> list:
        return [list(row) for row in self.since]

    def load_state_dict(self, saved: list) -> None:
        if saved and not isinstance(saved[0], list):  # one level's counts
            saved = [saved]
        for row, values in zip(self.since, saved, strict=False):
            row[:] = [float(n) for n in values]

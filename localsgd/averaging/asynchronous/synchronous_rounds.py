"""The syncer's synchronous rounds inside asynchronous ones (`SynchronousRounds`, a part of
`SyncerService`): where every worker sends at one time, nothing is pending and none is stale,
the syncer answers them with a synchronous round instead of point-to-point exchanges: the
all-reduced mean over the training's own process group (NCCL on CUDA) and the wire's format,
the outer step on the syncer, a broadcast: the synchronous rounds' bits, where point-to-point
exchanges would bring every worker's contribution to rank 0 and the global model back to each,
N times the model through one rank.

Under the modelled clock the syncer knows when every worker sends at one time. On the wall
clock no two messages arrive at one time, so a header that could be part of such a round
(nothing pending, trained from the newest global model, of the kind and fragments of those
held) is held undecided, its sender waiting, for at most the grace window from the first one
held (`Gathering`): if every worker's arrives in that time they make a synchronous round;
otherwise (the window passed, or a header that cannot join arrived) the held ones go on as
they would have, in their order of arrival, point-to-point. A sender waits no longer than the
window either way: it would wait that long for the merge that takes its contribution.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from localsgd.averaging.asynchronous.messages import MEET, SEND


class Gathering:
    """Headers held for a synchronous round. `size`: the workers; `window()`: the grace
    window's seconds now (0: nothing is held)."""

    def __init__(self, size: int, window: Callable[[], float]):
        self.size, self.window = size, window
        self.held: dict[int, dict] = {}

    def joins(self, header: dict, versions: list[int], idle: bool) -> bool:
        """Whether `header` can wait for a synchronous round with those held: a send or a
        meeting trained from the newest global model (`versions`), like the others held;
        `idle`: nothing is pending or waiting at the syncer."""
        if self.size < 2 or self.window() <= 0 or not idle or header["versions"] != versions:
            return False
        first = next(iter(self.held.values()), header)
        return header["kind"] == first["kind"] and header["fragments"] == first["fragments"]

    def hold(self, r: int, header: dict) -> dict[int, dict] | None:
        """Hold worker r's header; every worker's once they are all held (in rank order)."""
        self.held[r] = header
        if len(self.held) < self.size:
            return None
        return self.take()

    def take(self) -> dict[int, dict]:
        """The held headers, in rank order, none held any more."""
        held, self.held = dict(sorted(self.held.items())), {}
        return held

    def expired(self, now: float) -> bool:
        """Whether the window from the first header held has passed."""
        if not self.held:
            return False
        return min(h["arrived"] for h in self.held.values()) + self.window() <= now

    def in_arrival_order(self) -> list[tuple[int, dict]]:
        """The held headers, none held any more, as they arrived (to go on point-to-point)."""
        held, self.held = self.held, {}
        return sorted(held.items(), key=lambda item: item[1]["arrived"])


class SynchronousRounds:
    """`SyncerService`'s synchronous rounds (see the module doc): which messages make one, and
    the round itself; `gathering` holds the wall clock's headers meanwhile."""

    def _gathered(self, headers: dict[int, dict]) -> bool:
        """On the wall clock: whether a sender's header is held for a synchronous round of
        every worker (`gathering`), or made one; the ones held go on point-to-point where it
        cannot join them."""
        ((r, header),) = headers.items()
        idle = not (self.syncer.pending or self.waiting or self.deadline is not None)
        if not (
            self.collective_rounds
            and not header.get("in_flight")  # it trains on: there is no round to wait in
            and self.gathering.joins(header, self.syncer.versions, idle)
        ):
            self._release()
            return False
        every = self.gathering.hold(r, header)
        if every is None:
            return True
        if self._round_fits(every):
            for w, h in every.items():
                if h["kind"] == SEND:
                    self.pacing.arrived(w, h["arrived"])
            self._collective(max(h["arrived"] for h in every.values()), every)
        else:
            for w, h in sorted(every.items(), key=lambda item: item[1]["arrived"]):
                self._handle(h["arrived"], {w: h})
        return True

    def _release(self) -> None:
        """The headers held for a synchronous round go on point-to-point, as they arrived."""
        for w, h in self.gathering.in_arrival_order():
            self._handle(h["arrived"], {w: h})

    def _round_fits(self, headers: dict[int, dict]) -> bool:
        """Whether `headers` make a synchronous round: every worker's, of one kind and the same
        fragments, nothing pending and none stale, and a mean the all-reduce can form."""
        syncer = self.syncer
        samples = [h["samples"] for h in headers.values()]
        return (
            self.collective_rounds
            and not any(h.get("in_flight") for h in headers.values())
            and len(headers) == self.size
            and len({h["kind"] for h in headers.values()}) == 1
            and len({tuple(h["fragments"]) for h in headers.values()}) == 1
            and not syncer.pending
            and not self.waiting
            and all(h["versions"] == syncer.versions for h in headers.values())
            and sum(samples) > 0
            # the all-reduce weighs by samples: a normalized merge of unequal ones is the
            # syncer's own
            and not (syncer.normalized and any(n != samples[0] for n in samples))
        )

    def _collective(self, now: float, headers: dict) -> None:
        """Every worker at one time, nothing pending: a synchronous round (see the module doc)."""
        kind = next(iter(headers.values()))["kind"]
        samples = [h["samples"] for h in headers.values()]
        weights = [h["weights"] for h in headers.values()]
        weighted = any(w != weights[0] for w in weights)
        fragments = next(iter(headers.values()))["fragments"]
        versions = [v + (f in fragments) for f, v in enumerate(self.syncer.versions)]
        # an adaptive period decides on the round's losses before the round: its decision is
        # in every worker's answer, as after a synchronous round
        self.syncer.reported([
            (r, h.get("loss"), len(fragments) if h["kind"] == SEND else 0)
            for r, h in headers.items() if h["samples"] > 0
        ])  # fmt: skip
        period = self._period()
        self.collective_done.clear()
        for r, h in headers.items():
            if self.modelled and h["kind"] == SEND and self._moved(h):
                self.announced[r] = None  # it announces its next time again, at the new period
            self.links.box(r).put(
                f"d/{r}/{h['seq']}",
                {"do": "collective", "weighted": weighted, "time": now, "versions": versions,
                 "workers": sum(s > 0 for s in samples), **period},
            )  # fmt: skip
        if not self.collective_done.wait(self.timeout_s):
            raise TimeoutError("the synchronous round's mean never came (dist.timeout_s)")
        self._record(now, len(headers), [0] * len(headers), "collective" + (kind == MEET) * " meet")

    def collective_merged(
        self, means: list[list[torch.Tensor]], samples: list[float], workers: int, fragments
    ) -> None:
        """Rank 0's training thread, in a synchronous round of `workers` contributions: each
        fragment's all-reduced mean is in `means` (its samples in `samples`); the outer steps
        run here and each mean takes its fragment's new global values."""
        with self.lock:
            for mean, n, f in zip(means, samples, fragments, strict=True):
                self.syncer.step_(mean, n, workers, f)
                for m, v in zip(mean, self.syncer.values_of(f), strict=True):
                    m.copy_(v)
        self.collective_done.set()

"""Delayed averaging: the all-reduce runs while the next step computes, applied one step late.

At a sync each rank copies its state `x_s` aside, launches asynchronous all-reduces of a copy
bucket by bucket, and goes on training. One optimizer step later it waits for them and applies
`x <- mean(x_s) + (x_{s+1} - x_s)`: the average of the states at the sync plus the rank's own
progress since (the delayed averaging of DaSGD, Zhou et al. 2020; Streaming DiLoCo overlaps its
outer step the same way). No local step is thrown away, but the replicas are never
bit-identical: each differs from the common average by its one step of progress. What every rank
receives, `mean(x_s)`, is identical, bit for bit.

Costs two model-sized buffers, allocated once: the launch copy (it becomes the average) and the
rank's state at the sync.

This is `PeriodicAverager(overlap=True)`, the torch-style library form. The general mechanism is
`StreamingAverager(delay_steps=τ, merge_rule="progress")` (any τ, fragments, an outer step),
which at τ=1, one fragment and plain averaging computes the same bits (it shares `buckets` and
`keep_progress_` with this module; `tests/test_overlap.py` compares them): the trainer's
`sync.overlap=true` runs that.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator, PendingMean
from localsgd.averaging.flat import Relayout
from localsgd.averaging.reduce import Reducer


def buckets(pieces: list[torch.Tensor], bucket_bytes: int | None) -> list[torch.Tensor]:
    """`pieces` split into views of at most `bucket_bytes` each (None: as they are), so that the
    first transfers start while later buckets are still being scaled."""
    if bucket_bytes is None:
        return list(pieces)
    return [b for t in pieces for b in t.split(max(1, bucket_bytes // t.element_size()))]


def keep_progress_(local: torch.Tensor, average: torch.Tensor, origin: torch.Tensor) -> None:
    """`local <- average + (local - origin)`: the delayed average plus this rank's progress since
    `origin` was taken (in this order of operations, which every delayed merge here shares)."""
    local.sub_(origin).add_(average)


class DelayedMean(Reducer):
    """The in-flight average of a list of flat buffers: `launch_()` at a sync, `finish_()` one
    step later. A blocking `reduce_` (an average outside the schedule) is the plain mean."""

    delays = True

    def __init__(self, buffers: list[torch.Tensor], bucket_bytes: int):
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.averages = [torch.empty_like(b) for b in buffers]  # the launch copies, reduced
        self.origins = [torch.empty_like(b) for b in buffers]  # this rank's state at the sync
        self.in_flight: PendingMean | None = None
        self.pending = False  # an average is launched (or restored) and not yet merged

    def launch_(self, buffers: list[torch.Tensor], comm: Communicator) -> None:
        """Start averaging `buffers` as they are now; returns without waiting."""
        if self.pending:
            raise RuntimeError("an average is still in flight: finish_() it before another")
        for flat, average, origin in zip(buffers, self.averages, self.origins, strict=True):
            origin.copy_(flat)
            average.copy_(flat)
        self.in_flight = comm.launch_mean_(buckets(self.averages, self.bucket_bytes))
        self.pending = True

    def wait(self) -> None:
        """Block until the launched all-reduces are done (and a simulated link's time is up)."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None

    def finish_(self, buffers: list[torch.Tensor]) -> None:
        """Wait for the average and apply it: `x <- average + (x - origin)`."""
        self.wait()
        for flat, average, origin in zip(buffers, self.averages, self.origins, strict=True):
            keep_progress_(flat, average, origin)
        self.pending = False

    def relayout(self, convert: Relayout) -> None:
        self.wait()
        self.averages, self.origins = convert(self.averages), convert(self.origins)

    def state_dict(self) -> dict:
        """The average in flight (waited for) and the state it was launched from, so that a
        resumed run merges exactly what the uninterrupted one would have."""
        if not self.pending:
            return {"pending": False}
        self.wait()
        return {
            "pending": True,
            "averages": [a.detach().clone() for a in self.averages],
            "origins": [o.detach().clone() for o in self.origins],
        }

    def load_state_dict(self, state: dict) -> None:
        self.in_flight = None
        self.pending = bool(state.get("pending", False))
        if self.pending:
            for mine, saved in zip(self.averages, state["averages"], strict=True):
                mine.copy_(saved)
            for mine, saved in zip(self.origins, state["origins"], strict=True):
                mine.copy_(saved)

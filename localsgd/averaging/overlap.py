"""Delayed averaging: the all-reduce runs while the next step computes, applied one step late.

At a sync each rank copies its state `x_s` aside, launches asynchronous all-reduces of a scaled
copy bucket by bucket, and goes on training. One optimizer step later it waits for them and
applies `x <- mean(x_s) + (x_{s+1} - x_s)`: the average of the states at the sync plus the
rank's own progress since (the delayed averaging of DaSGD, Zhou et al. 2020; Streaming DiLoCo
overlaps its outer step the same way). No local step is thrown away, but the replicas are never
bit-identical: each differs from the common average by its one step of progress. What every rank
receives, `mean(x_s)`, is identical, bit for bit.

Costs two model-sized buffers, allocated once: the launch copy (it becomes the average) and the
rank's state at the sync.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, SimulatedLink


class DelayedMean:
    """The in-flight average of a list of flat buffers: `launch()` at a sync, `merge()` later."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        group: dist.ProcessGroup | None,
        world_size: int,
        use_avg: bool,
        bucket_bytes: int,
        link: SimulatedLink | None = None,
    ):
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes!r}")
        self.group = group
        self.world_size = world_size
        self.use_avg = use_avg
        self.bucket_bytes = bucket_bytes
        self.link = link
        self.averages = [torch.empty_like(b) for b in buffers]  # the launch copies, reduced
        self.origins = [torch.empty_like(b) for b in buffers]  # this rank's state at the sync
        self.works: list[dist.Work] = []
        self.pending = False  # an average is launched (or restored) and not yet merged
        self.launched_at = 0.0

    def _buckets(self, flat: torch.Tensor) -> int:
        return max(1, self.bucket_bytes // flat.element_size())

    def launch(self, buffers: list[torch.Tensor], stats: CommStats) -> None:
        """Start averaging `buffers` as they are now; returns without waiting."""
        if self.pending:
            raise RuntimeError("an average is still in flight: merge() it before launching another")
        start = self.launched_at = time.perf_counter()
        op = dist.ReduceOp.AVG if self.use_avg else dist.ReduceOp.SUM
        for flat, average, origin in zip(buffers, self.averages, self.origins, strict=True):
            origin.copy_(flat)
            size = self._buckets(flat)
            # Bucket by bucket, so that scaling the next bucket overlaps the previous transfer.
            for src, dst in zip(flat.split(size), average.split(size), strict=True):
                if self.use_avg:
                    dst.copy_(src)
                else:  # divide first, as torch's average_parameters does (and as blocking does)
                    torch.div(src, self.world_size, out=dst)
                self.works.append(dist.all_reduce(dst, op=op, group=self.group, async_op=True))
            stats.bytes += flat.numel() * flat.element_size()
        self.pending = True
        stats.seconds += time.perf_counter() - start

    def wait(self, stats: CommStats | None = None) -> None:
        """Block until the launched all-reduces are done (and a simulated link's time is up)."""
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        if self.works and self.link is not None:
            nbytes = sum(a.numel() * a.element_size() for a in self.averages)
            self.link.wait_out(self.launched_at, nbytes)
        self.works.clear()
        if stats is not None:
            stats.seconds += time.perf_counter() - start

    def merge(self, buffers: list[torch.Tensor], stats: CommStats) -> None:
        """Wait for the average and apply it: `x <- average + (x - origin)`."""
        self.wait(stats)
        for flat, average, origin in zip(buffers, self.averages, self.origins, strict=True):
            flat.sub_(origin).add_(average)  # the local progress since the sync, on the average
        self.pending = False

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
        self.works.clear()
        self.pending = bool(state.get("pending", False))
        if self.pending:
            for mine, saved in zip(self.averages, state["averages"], strict=True):
                mine.copy_(saved)
            for mine, saved in zip(self.origins, state["origins"], strict=True):
                mine.copy_(saved)

"""The one collective the averagers use, and the counters they keep."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """What one worker communicated. A round is one step at which workers communicated."""

    rounds: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.rounds, self.bytes, self.seconds = (
            int(state["rounds"]),
            int(state["bytes"]),
            float(state["seconds"]),
        )


def supports_avg(group: dist.ProcessGroup | None) -> bool:
    """NCCL averages inside the reduction; gloo has no ReduceOp.AVG."""
    return dist.get_backend(group) == dist.Backend.NCCL


# gloo progresses several queued operations at once, so the division of one bucket overlaps the
# transfer of the previous ones; buckets much smaller than this pay a fixed per-operation cost.
BUCKET_BYTES = 4 << 20


def all_reduce_mean_(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    use_avg: bool,
    stats: CommStats | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Replace `flat` in place by its mean over the group.

    NCCL averages inside the reduction. On gloo each bucket (a view of `flat`) is divided and
    then all-reduced asynchronously, all buckets in flight together. Dividing before the sum (as
    torch's `average_parameters` does) keeps the result identical on every rank, since every rank
    reduces the same bytes.
    """
    start = time.perf_counter()
    if use_avg:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    else:
        works = []
        for bucket in flat.split(max(1, bucket_bytes // flat.element_size())):
            bucket.div_(world_size)
            works.append(dist.all_reduce(bucket, group=group, async_op=True))
        for work in works:
            work.wait()
    if stats is not None:
        stats.bytes += flat.numel() * flat.element_size()
        stats.seconds += time.perf_counter() - start

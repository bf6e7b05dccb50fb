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


def all_reduce_mean_(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    use_avg: bool,
    stats: CommStats | None = None,
) -> None:
    """Replace `flat` in place by its mean over the group.

    Dividing before the sum (as torch's `average_parameters` does) keeps the result identical on
    every rank, since the reduced bytes are the same everywhere.
    """
    start = time.perf_counter()
    if use_avg:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    else:
        flat.div_(world_size)
        dist.all_reduce(flat, group=group)
    if stats is not None:
        stats.bytes += flat.numel() * flat.element_size()
        stats.seconds += time.perf_counter() - start

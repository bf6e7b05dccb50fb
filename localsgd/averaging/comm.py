"""The one collective the averagers use, the counters they keep, and a simulated slow link."""

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


@dataclass(frozen=True)
class SimulatedLink:
    """A network slower than the real one: every collective lasts at least
    `latency_ms + payload bytes / bandwidth`, the payload being the bytes one worker puts into it.

    The real collective runs first (so results are real); then the caller sleeps whatever is
    left of the simulated time. Only the sleep is simulated, so a link faster than the real
    transport changes nothing. Lets one machine show how a strategy behaves on a 100 Mbit/s or
    cross-continent link.
    """

    bandwidth_gbps: float | None = None  # None: unlimited (latency only)
    latency_ms: float = 0.0

    def __post_init__(self):
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ValueError(
                f"comm.simulate.bandwidth_gbps must be > 0 (or null), got {self.bandwidth_gbps!r}"
            )
        if not self.latency_ms >= 0:
            raise ValueError(f"comm.simulate.latency_ms must be >= 0, got {self.latency_ms!r}")

    def seconds(self, nbytes: int) -> float:
        """How long a collective of `nbytes` per worker takes on this link."""
        transfer = 0.0 if self.bandwidth_gbps is None else nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return self.latency_ms / 1e3 + transfer

    def wait_out(self, start: float, nbytes: int) -> None:
        """Sleep until `start + seconds(nbytes)` (start from `time.perf_counter()`)."""
        left = start + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)


def supports_avg(group: dist.ProcessGroup | None) -> bool:
    """NCCL averages inside the reduction; gloo has no ReduceOp.AVG."""
    return dist.get_backend(group) == dist.Backend.NCCL


def all_reduce_mean_(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    use_avg: bool,
    stats: CommStats | None = None,
    link: SimulatedLink | None = None,
) -> None:
    """Replace `flat` in place by its mean over the group, with one all-reduce.

    NCCL averages inside the reduction. gloo has no AVG: the buffer is divided in place first (as
    torch's `average_parameters` does), which keeps the result identical on every rank, since
    every rank reduces the same bytes. (Splitting it into asynchronous ~4 MB buckets so that the
    division overlaps the transfer was measured: slower on a quiet machine, see
    experiments/bench/RESULTS.md.) With a `link`, the call lasts at least the link's time.
    """
    start = time.perf_counter()
    if use_avg:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    else:
        flat.div_(world_size)
        dist.all_reduce(flat, group=group)
    if link is not None:
        link.wait_out(start, flat.numel() * flat.element_size())
    if stats is not None:
        stats.bytes += flat.numel() * flat.element_size()
        stats.seconds += time.perf_counter() - start

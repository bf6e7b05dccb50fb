"""Replica drift: how far the workers' models have wandered apart when they are averaged.

Drift at an average = the mean over workers of ||x_i - x_avg||_2, with x_i a worker's parameters
(and floating-point buffers) just before the average and x_avg what every worker holds after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DriftMeter:
    """Measures drift around each average with one extra scalar all-reduce, nothing in between:
    an averager's global-sync hook (`Averager.global_hooks`), given the flat buffers. The
    all-reduce is launched and waited for only when the drift is read (`take`, `state_dict`):
    a delayed average is merged a step after its launch, and a blocking collective there would
    make every worker wait for the slowest a second time each round.

    The flat buffers are averaged in place, so x_i is gone once the average is done: `before()`
    copies it into a scratch buffer allocated once here (one model-sized copy, never reallocated);
    `after()` subtracts the average from it in place and all-reduces the norm. The textbook
    shortcut mean_i ||x_i||^2 - ||x_avg||^2 needs no scratch but cancels catastrophically in
    fp32 when drift is small next to the weights, which is exactly when it matters.
    """

    def __init__(
        self,
        buffers: list[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
    ):
        # `group`: the replicas averaged together; `shard_group`: with sharded replica groups,
        # the ranks whose buffers hold the other shards of this rank's model
        self.group = group
        self.shard_group = shard_group
        self.world_size = dist.get_world_size(group)
        # sharded (mirror mode), the scratch lives only from `before()` to `after()`, as the
        # buffers do: a persistent copy would cost a rank as much again as its shards
        self.transient = shard_group is not None
        self.scratch = [] if self.transient else [torch.empty_like(b) for b in buffers]
        device = buffers[0].device if buffers else torch.device("cpu")
        self.device = device
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # launched, not yet summed
        # drift summed over the averages since the last `take()`, kept on the device so that no
        # average has to wait for a `.item()`
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.count = 0

    def before(self, buffers: list[torch.Tensor]) -> None:
        if [b.shape for b in buffers] != [s.shape for s in self.scratch]:  # rebuilt buffers
            self.scratch = [torch.empty_like(b) for b in buffers]
        for scratch, flat in zip(self.scratch, buffers, strict=True):
            scratch.copy_(flat)

    def after(self, buffers: list[torch.Tensor]) -> None:
        # the last average's all-reduce, launched a round ago, is done: summing it here keeps
        # one in flight on ranks that never log (only rank 0 reads `take`)
        self.wait()
        distance = self._distance(buffers)
        # the one extra (scalar) collective
        self.pending.append((dist.all_reduce(distance, group=self.group, async_op=True), distance))
        self.count += 1

    def _distance(self, buffers: list[torch.Tensor]) -> torch.Tensor:
        """This worker's ||x_i - x_avg||_2 (the whole model's, over its shards), from the copy
        `before()` took and the averaged `buffers`."""
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for scratch, flat in zip(self.scratch, buffers, strict=True):
            scratch.sub_(flat)
            # fp32 norm (torch reduces it blockwise, and its terms are all positive, so it does not
            # cancel); a dtype=float64 norm would first cast a model-sized copy
            squared += torch.linalg.vector_norm(scratch).double().square()
        if self.shard_group is not None:  # the whole model's distance, over its shards
            dist.all_reduce(squared, group=self.shard_group)
        if self.transient:
            self.scratch = []
        return squared.sqrt_()

    def wait(self) -> None:
        """Wait for the launched all-reduces and sum them into `total`."""
        for work, distance in self.pending:
            work.wait()
            self.total += distance / self.world_size
        self.pending.clear()

    def take(self) -> float | None:
        """Mean drift over the averages since the last call (None if there was none); resets."""
        self.wait()
        if self.count == 0:
            return None
        value = (self.total / self.count).item()
        self.total.zero_()
        self.count = 0
        return value

    def state_dict(self) -> dict:
        """The drift pending for the next log line, so a resumed run logs what it would have."""
        self.wait()
        return {"total": self.total.detach().clone(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total.copy_(state["total"])
        self.count = int(state["count"])


class RoundDriftMeter(DriftMeter):
    """Drift under `ft=torchft` with synchronous rounds, where each replica group is a world of
    its own and the mean across the groups is a round of torchft's Manager
    (`localsgd.averaging.torchft.FaultTolerantRounds`). Around each average of a round the
    distances are summed inside the replica group (torch.distributed, `group`), then across the
    round's live replica groups through the round's own communicator (`comm.sum_`: one scalar
    all-reduce, blocking, as no collective may outlive its round), and divided by the round's
    workers (`comm.size`): the same mean over workers as `DriftMeter`'s, a healing replica left
    out as it is of the average. The figure is held until the round ends (`round_ended`, one of
    the rounds' listeners): kept if the round committed, dropped if it was rolled back, whose
    average never became the global model.
    """

    def __init__(
        self,
        buffers: list[torch.Tensor],
        comm,  # the rounds' TorchftCommunicator
        group: dist.ProcessGroup | None = None,
        shard_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(buffers, group, shard_group)
        self.comm = comm
        self.held: list[torch.Tensor] = []  # this round's figures, until it commits

    def after(self, buffers: list[torch.Tensor]) -> None:
        distance = self._distance(buffers)
        if self.world_size > 1:  # the replica group's workers
            dist.all_reduce(distance, group=self.group)
        if self.comm.sum_(distance):
            self.held.append(distance / self.comm.size)

    def round_ended(self, committed: bool) -> None:
        if committed:
            for distance in self.held:
                self.total += distance
                self.count += 1
        self.held.clear()

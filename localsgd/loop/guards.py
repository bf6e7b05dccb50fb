"""Guards a run checks at log, checkpoint and sync steps: non-finite losses and replicas that
are not bit-identical after a sync."""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.checksum import replica_checksum
from localsgd.loop.metrics import notice

# ----------------------------------------------------------------------------------------------
# NaN / inf losses.
# ----------------------------------------------------------------------------------------------


# trainer.nan_policy. error: a non-finite loss stops the run (NonFiniteTracker.check raises at
# the next log or checkpoint step); skip: the trainer skips that step's update
NAN_POLICIES = ("error", "skip")


class NonFiniteLoss(RuntimeError):
    pass


class NonFiniteTracker:
    """Remembers, on the device, the first step whose loss was not finite: no host sync per step
    (a `.item()` every step would stall CUDA); `check()` reads it at log and checkpoint steps."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        bad = (~torch.isfinite(loss)) & (self.first_bad < 0)
        self.first_bad = torch.where(bad, torch.full_like(self.first_bad, step), self.first_bad)

    def check(self, rank: int) -> None:
        step = int(self.first_bad)
        if step >= 0:
            raise NonFiniteLoss(
                f"non-finite loss at step {step} on rank {rank}; lower optim.lr, or set "
                f"trainer.nan_policy=skip to skip such steps (the last checkpoint is kept)"
            )


# ----------------------------------------------------------------------------------------------
# Replica check: after a sync, every rank's parameters must be bit-identical.
# ----------------------------------------------------------------------------------------------


class ReplicasDiverged(RuntimeError):
    pass


def check_replicas(
    buffers: list[torch.Tensor], step: int, rank: int, group: dist.ProcessGroup | None = None
) -> None:
    """Fail unless every rank of `group` (None: every rank) holds `buffers` bit for bit (with
    sharded replica groups: the ranks holding the same shard)."""
    mine = replica_checksum(buffers)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differ:
        raise ReplicasDiverged(
            f"replicas differ after the sync at step {step}: rank(s) {differ} do not match "
            f"rank 0 (checked on rank {rank}; sync.check_replicas=true)"
        )


class DroppedContributions:
    """The contributions the all-reduced averages left out for holding NaN/Inf
    (`localsgd.averaging.finite`), as (rank, step): the same on every rank of a group. Rank 0
    names each once."""

    def __init__(self, at: list[tuple[int, int]] | None = None):
        self.at = at if at is not None else []  # the averager's list: checkpointed with it

    def collect(self, comms, step: int) -> None:
        """Take the ranks each communicator dropped since the last call (levels share a list)."""
        lists = {id(c.dropped): c.dropped for c in comms if getattr(c, "dropped", None)}
        for dropped in lists.values():
            for rank in dropped:
                self.at.append((rank, step))
                if not dist.is_initialized() or dist.get_rank() == 0:
                    notice(
                        f"nonfinite: worker {rank}'s contribution at step {step} held NaN/Inf: "
                        "dropped from the average (sync.drop_nonfinite)"
                    )
            dropped.clear()

"""How the syncs run without fault tolerance: straight through torch.distributed.

`LocalRounds` is one of the two round drivers the `Synchroniser` is given (the other is
`localsgd.loop.fault_tolerance.FaultTolerance`, `ft=torchft`): the same methods, so the
Synchroniser has no branch for fault tolerance. Here a sync is the averager's own collective, a
warmup step's gradients one all-reduce, and every rank writes its own checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from localsgd.averaging import Averager, GradientAverager
from localsgd.loop.stop import StopAgreement


class LocalRounds:
    """The syncs of `averager` (and a warmup's gradient averages) as plain collectives."""

    checks_inside = False  # replica checks run after the sync, not inside a round
    shared_checkpoints = False  # every rank writes its own state
    comms: tuple = ()  # no communicator beside the averager's and the warmup's

    def __init__(self, averager: Averager, gradients: GradientAverager | None = None):
        self.averager, self.gradients = averager, gradients

    def join(
        self, registry: Mapping[str, Any], optimizer_step: Callable[[], None], step: int, every: int
    ) -> str:
        """Nothing to join: every worker starts fresh (or from its own checkpoint)."""
        return "fresh"

    def stepped(self) -> None:
        pass

    def all_reduce_gradients(self) -> bool:
        self.gradients.all_reduce()
        return True

    def maybe_average(self) -> None:
        self.averager.maybe_average()

    def average(self) -> bool:
        self.averager.average()
        return True

    @property
    def worker(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    rolled_back = False  # no round is ever put back

    @property
    def speaks(self) -> bool:
        """Rank 0 names what every rank saw (trust events)."""
        return not dist.is_initialized() or dist.get_rank() == 0

    @property
    def replica_checks(self) -> int:
        return 0

    def checkpoint(
        self,
        step: int,
        max_steps: int,
        every: int,
        stop: StopAgreement,
        save: Callable[..., str],
        final: bool,
        **_,
    ) -> bool:
        """Every rank its own state, when due (every `every` steps and at the end) or at an
        agreed stop; True to stop there. The final average's state: the last step took it."""
        if final:
            return False
        # (a stop agreed for the very last step just lets the run finish)
        stopping = stop.should_stop(step) and step < max_steps
        due = every > 0 and (step % every == 0 or step == max_steps)
        if due or stopping:
            save()
        return stopping

    def writes_results(self, rank: int) -> bool:
        return rank == 0

    def evaluates_final(self, rank: int, sharding) -> bool:
        return sharding.evaluates(rank)

    def record(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

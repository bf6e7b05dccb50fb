"""Period schedules: how many local steps run between two averages, possibly changing over time.

A schedule answers `period_at(step)`; an averager averages when at least that many steps have
passed since its last average (which, for a constant period, is exactly torch's rule). Adaptive
schedules change the period in `update(loss)`, called after each average with the training loss
averaged over the workers as part of that same sync, so every rank takes the same decision.
"""

from __future__ import annotations

import math

import torch


def cycle_length(schedule: ConstantPeriod, step: int, fragments: int, least: int = 1) -> int:
    """A cycle of `fragments` staggered rounds (Streaming DiLoCo's, synchronous or not): the
    schedule's period at `step` rounded up to a multiple of `fragments`, and at least `least`."""
    return max(least, -(-schedule.period_at(step) // fragments) * fragments)


class ConstantPeriod:
    """k fixed for the whole run (torch's `PeriodicModelAverager`)."""

    needs_loss = False  # reads the training loss, through a slot in the averaged buffer
    varies = False  # the period can change during the run
    averages = True  # False: never averages (the no-communication baseline)

    def __init__(self, period: int):
        if period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        self.period = period

    def period_at(self, step: int) -> int:
        return self.period

    def reachable(self) -> list[int]:
        """Every period the schedule can take over a run, ascending."""
        return [self.period]

    def update(self, loss: float | None) -> None:
        """Constant: nothing to learn from the sync."""

    def loss_slots(self, device: torch.device) -> list[torch.Tensor]:
        """Tensors to average along with the model: the loss slot of a schedule that reads it."""
        return []

    def observe_loss(self, loss: torch.Tensor) -> None:
        pass

    def before_sync(self) -> None:
        pass

    def after_sync(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"period": self.period}

    def load_state_dict(self, state: dict) -> None:
        self.period = int(state["period"])


class NeverAverage(ConstantPeriod):
    """No average at all, not even a final one: the workers train independently (a baseline for
    what communication buys; `comm.disabled` in the trainer)."""

    averages = False

    def __init__(self):
        super().__init__(1)


class StepPeriod(ConstantPeriod):
    """k multiplied by `factor` at each of `milestones` (Lin et al. grow k with the LR decay)."""

    varies = True

    def __init__(self, period: int, factor: int, milestones: list[int]):
        super().__init__(period)
        if factor < 1:
            raise ValueError(f"factor must be an integer >= 1, got {factor!r}")
        self.factor = factor
        self.milestones = sorted(int(m) for m in milestones)

    def period_at(self, step: int) -> int:
        return self.period * self.factor ** sum(step >= m for m in self.milestones)

    def reachable(self) -> list[int]:
        return sorted({self.period * self.factor**k for k in range(len(self.milestones) + 1)})


class AdaptivePeriod(ConstantPeriod):
    """Grows k while the synchronised training loss keeps falling, shrinks it when it stalls.

    After each sync, `loss` is the mean over workers of each worker's mean training loss since
    the previous sync. If it fell by at least `tolerance` (relative) below the previous one, k is
    multiplied by `factor` (up to `max_period`): progress is steady, so communicate less. If it
    did not, k is divided by `factor` (down to `min_period`): the replicas drift apart or the
    optimisation stalls, so pull them together more often. The decision reads synchronised values
    only, so it is the same on every rank.
    """

    needs_loss = True
    varies = True

    def __init__(
        self,
        period: int,
        min_period: int = 1,
        max_period: int = 256,
        factor: int = 2,
        tolerance: float = 0.01,
    ):
        super().__init__(period)
        if not 1 <= min_period <= period <= max_period:
            raise ValueError(
                f"need 1 <= min_period <= period <= max_period, got {min_period}, {period}, "
                f"{max_period}"
            )
        if factor < 2:
            raise ValueError(f"factor must be an integer >= 2, got {factor!r}")
        self.min_period, self.max_period = min_period, max_period
        self.factor, self.tolerance = factor, tolerance
        self.last_loss = math.inf
        self.loss_slot: torch.Tensor | None = None  # this worker's loss summed since the sync
        self.loss_count = 0

    def reachable(self) -> list[int]:
        seen, todo = set(), [self.period]
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            todo += [min(self.max_period, k * self.factor), max(self.min_period, k // self.factor)]
        return sorted(seen)

    def loss_slots(self, device: torch.device) -> list[torch.Tensor]:
        if self.loss_slot is None:
            self.loss_slot = torch.zeros(1, device=device)
        return [self.loss_slot]

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Summed on the device: nothing is read back until the next sync."""
        self.loss_slot.add_(loss.detach())
        self.loss_count += 1

    def before_sync(self) -> None:
        if self.loss_count > 0:
            self.loss_slot.div_(self.loss_count)  # this worker's mean loss since the last sync

    def after_sync(self) -> None:
        synced = float(self.loss_slot.item()) if self.loss_count > 0 else None
        self.loss_slot.zero_()
        self.loss_count = 0
        self.update(synced)

    def update(self, loss: float | None) -> None:
        if loss is None or not math.isfinite(loss):
            return
        if math.isfinite(self.last_loss):
            if loss <= self.last_loss * (1 - self.tolerance):
                self.period = min(self.max_period, self.period * self.factor)
            else:
                self.period = max(self.min_period, self.period // self.factor)
        self.last_loss = loss

    def state_dict(self) -> dict:
        state = {"period": self.period, "last_loss": self.last_loss, "loss_count": self.loss_count}
        if self.loss_slot is not None:  # the loss summed since the last sync, for an exact resume
            state["loss_slot"] = self.loss_slot.detach().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.period = int(state["period"])
        self.last_loss = float(state["last_loss"])
        self.loss_count = int(state.get("loss_count", 0))
        if self.loss_slot is not None and "loss_slot" in state:
            self.loss_slot.copy_(state["loss_slot"])

"""Periodic model averaging, the local-SGD primitive, with torch's step semantics."""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, SimulatedLink, all_reduce_mean_, supports_avg
from localsgd.averaging.flat import FlatBuffers, averaged_tensors


class PeriodicAverager:
    """Averages a module's parameters and floating-point buffers every `period` steps.

    A drop-in for `torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`:
    call `step()` once after every `optimizer.step()`. With the internal counter `s` (starting at
    0), it averages when `s >= warmup_steps and (s - warmup_steps) % period == 0`, exactly as
    torch does. Unlike torch, the tensors become views of persistent flat buffers on construction,
    so an average is one in-place all-reduce per buffer and allocates nothing.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
    ):
        if period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.period = period
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.use_avg = supports_avg(process_group)
        self.flat = FlatBuffers(averaged_tensors(module))
        self.stats = stats if stats is not None else CommStats()
        self.link = link  # a simulated slow network, or None
        self.step_index = 0

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step belongs to the synchronous warmup."""
        return self.step_index < self.warmup_steps

    def should_average(self, step_index: int) -> bool:
        return (
            step_index >= self.warmup_steps and (step_index - self.warmup_steps) % self.period == 0
        )

    def step(self) -> bool:
        """Call after each optimizer step; averages when the rule says. Returns whether it did."""
        averaged = self.should_average(self.step_index)
        if averaged:
            self.average()
        self.step_index += 1
        return averaged

    def average_parameters(self, params=None) -> None:
        """torch's name for `step()`; the parameters are the module's, fixed at construction."""
        self.step()

    def average(self) -> None:
        """Average now, outside the schedule (e.g. once more before the final evaluation)."""
        for flat in self.flat.buffers:
            all_reduce_mean_(
                flat, self.process_group, self.world_size, self.use_avg, self.stats, link=self.link
            )
        self.stats.rounds += 1

    def state_dict(self) -> dict:
        return {"step": self.step_index, "period": self.period, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])

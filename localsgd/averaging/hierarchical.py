"""Hierarchical local SGD: averaging inside small groups often, across everyone rarely."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, all_reduce_mean_, supports_avg
from localsgd.averaging.compress import LowPrecisionMean, comm_dtype_of
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.periodic import AverageHook


@dataclass
class Level:
    period: int
    group_size: int
    group: dist.ProcessGroup | None  # this rank's group at this level; None = `process_group`
    stats: CommStats = field(default_factory=CommStats)


def check_levels(period_group_size_dict: dict[int, int], overall: int) -> None:
    """Periods and group sizes must grow together; each size divides the next; the last is all."""
    if not period_group_size_dict:
        raise ValueError("period_group_size_dict must not be empty")
    items = list(period_group_size_dict.items())
    for period, size in items:
        if period < 1 or size < 1:
            raise ValueError(f"periods and group sizes must be >= 1, got {period} -> {size}")
    for (p0, g0), (p1, g1) in zip(items, items[1:], strict=False):
        if not (p1 > p0 and g1 > g0 and g1 % g0 == 0):
            raise ValueError(
                "periods must grow with group size, and each group size divide the next, got "
                f"{p0} -> {g0} then {p1} -> {g1}"
            )
    if items[-1][1] != overall:
        raise ValueError(
            f"the last group size must be the size of the process group ({overall}), got "
            f"{items[-1][1]}"
        )


class HierarchicalAverager:
    """Averages within groups of contiguous ranks, each level with its own period.

    The same decisions as torch's `HierarchicalModelAverager(period_group_size_dict,
    warmup_steps)`: at step `s` (counted from 0, advanced by each `step()`), when
    `s >= warmup_steps`, the level with the largest period dividing `s` averages within its
    groups (note: `s`, not `s - warmup_steps`, as in torch). The module's tensors become views of
    persistent flat buffers, as in `PeriodicAverager`.

    Every rank of the default group must construct it, in the same order relative to other
    group creations (the subgroups are made with `dist.new_subgroups_by_enumeration`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        period_group_size_dict: dict[int, int],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        *,
        comm_dtype: str | torch.dtype = torch.float32,
    ):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        overall = dist.get_world_size(process_group)
        check_levels(period_group_size_dict, overall)
        ranks = (
            dist.get_process_group_ranks(process_group)
            if process_group is not None
            else list(range(overall))
        )
        self.levels: list[Level] = []
        for period, size in OrderedDict(period_group_size_dict).items():
            if size == overall:
                group = process_group
            else:
                chunks = [ranks[i : i + size] for i in range(0, overall, size)]
                group, _ = dist.new_subgroups_by_enumeration(chunks)
            self.levels.append(Level(period, size, group))
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.world_size = overall
        self.use_avg = supports_avg(process_group)
        self.flat = FlatBuffers(averaged_tensors(module))
        self.comm_dtype = comm_dtype_of(comm_dtype)
        self.compressor = (
            LowPrecisionMean(self.flat.buffers, self.comm_dtype, levels=len(self.levels))
            if self.comm_dtype != torch.float32
            else None
        )
        self.stats = stats if stats is not None else CommStats()
        self.hooks: list[AverageHook] = []
        self.step_index = 0
        self.all_in_sync = True  # every rank holds the same tensors (after a widest-level sync)

    @property
    def in_warmup(self) -> bool:
        return self.step_index < self.warmup_steps

    def level_at(self, step_index: int) -> int | None:
        """Index of the level averaging after step `step_index`, or None."""
        if step_index < self.warmup_steps:
            return None
        for i in reversed(range(len(self.levels))):
            if step_index % self.levels[i].period == 0:
                return i
        return None

    def averages_all(self, step_index: int) -> bool:
        """Whether the average after step `step_index` is the widest level's."""
        return self.level_at(step_index) == len(self.levels) - 1

    def next_sync(self, step_index: int) -> int:
        """The first step index >= `step_index` after which every rank averages (widest level)."""
        s = max(step_index, self.warmup_steps)
        return s + (-s) % self.levels[-1].period

    def observe_loss(self, loss: torch.Tensor) -> None:
        """No schedule adapts here; accepted so the trainer need not care which averager it has."""

    def step(self) -> bool:
        """Call after each optimizer step; averages at the level the rule picks. Returns whether
        any level averaged."""
        level = self.level_at(self.step_index)
        if level is not None:
            self.average_level(level)
        else:
            self.all_in_sync = False
        self.step_index += 1
        return level is not None

    def average_parameters(self, params=None) -> None:
        self.step()

    def average(self) -> None:
        """Average across every rank now (the widest level), e.g. before the final evaluation."""
        self.average_level(len(self.levels) - 1)

    def average_level(self, index: int) -> None:
        level = self.levels[index]
        before = self.stats.bytes
        if self.compressor is not None:
            self.compressor.all_reduce_mean_(
                self.flat.buffers, index, level.group, level.group_size, self.use_avg, self.stats
            )
        else:
            for flat in self.flat.buffers:
                all_reduce_mean_(flat, level.group, level.group_size, self.use_avg, self.stats)
        for hook in self.hooks:
            hook(level.group, level.group_size)
        self.stats.rounds += 1
        level.stats.rounds += 1
        level.stats.bytes += self.stats.bytes - before
        self.all_in_sync = index == len(self.levels) - 1

    def broadcast_(self, src: int = 0) -> None:
        for flat in self.flat.buffers:
            dist.broadcast(flat, src=src, group=self.process_group)
        if self.compressor is not None:
            self.compressor.reset(self.flat.buffers)

    def comm_levels(self) -> list[dict]:
        return [
            {
                "group_size": lv.group_size,
                "period": lv.period,
                "rounds": lv.stats.rounds,
                "bytes": lv.stats.bytes,
            }
            for lv in self.levels
        ]

    def state_dict(self) -> dict:
        state = {
            "step": self.step_index,
            "warmup_steps": self.warmup_steps,
            "levels": [lv.stats.state_dict() for lv in self.levels],
        }
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])
        for lv, saved in zip(self.levels, state.get("levels", []), strict=False):
            lv.stats.load_state_dict(saved)
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])

"""Hierarchical local SGD: averaging inside small groups often, across everyone rarely."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from localsgd.averaging.averager import Averager
from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.rounds import Rounds, whole
from localsgd.averaging.schedule import ConstantPeriod
from localsgd.averaging.wire.compress import comm_dtype_of
from localsgd.averaging.wire.quantize import DEFAULT_BLOCK_SIZE


def check_levels(period_group_size_dict: dict[int, int], overall: int) -> None:
    """What torch's `HierarchicalModelAverager` requires: at least one level, positive periods,
    group sizes that split the group into equal contiguous chunks, the last one the whole group.
    (Periods need not grow with group size: torch picks the last listed period dividing `step`.)
    """
    if not period_group_size_dict:
        raise ValueError("period_group_size_dict must not be empty")
    for period, size in period_group_size_dict.items():
        if period < 1 or size < 1 or overall % size != 0:
            raise ValueError(
                f"each period must be >= 1 and each group size divide the group's size "
                f"({overall}), got {period} -> {size}"
            )
    last = list(period_group_size_dict.values())[-1]
    if last != overall:
        raise ValueError(
            f"the last group size must be the size of the process group ({overall}), got {last}"
        )


def level_by_period(step: int, warmup_steps: int, periods: list[int]) -> int | None:
    """torch's hierarchical rule: after step `step` (from `warmup_steps` on), the last listed
    level whose period divides `step` averages (note: `step`, not `step - warmup_steps`)."""
    if step < warmup_steps:
        return None
    for i in reversed(range(len(periods))):
        if step % periods[i] == 0:
            return i
    return None


def inner_level_groups(comm: Communicator, inner: dict[int, int]) -> list[Communicator]:
    """The groups of each inner level (`{period: group_size}`, narrowest first: Streaming
    DiLoCo's and the asynchronous rounds' plain means below their widest level), subgroups of
    `comm`'s contiguous ranks, one set per distinct size. Collective over the default group."""
    for p, size in inner.items():
        if p < 1 or size < 1 or comm.size % size:
            raise ValueError(
                f"each inner level needs a period >= 1 and a group size dividing the "
                f"group's size ({comm.size}), got {p} -> {size}"
            )
    by_size: dict[int, Communicator] = {}
    for size in inner.values():
        if size not in by_size:
            by_size[size] = comm.subgroups(size)
    return [by_size[size] for size in inner.values()]


class HierarchicalAverager(Averager):
    """Averages within groups of contiguous ranks, each level with its own period: a drop-in for
    torch's `HierarchicalModelAverager(period_group_size_dict, warmup_steps, process_group)`.

    At step `s` (the integer `step`, from 0), when `s >= warmup_steps`, the last-listed level
    whose period divides `s` averages within its groups (note: `s`, not `s - warmup_steps`, as in
    torch). `period_process_group_dict` maps each period to this rank's group at that level, as
    torch's does. `module=`, `comm_dtype`, `link`, `init_sync`, `error_feedback` and
    `quant_block_size` as in `PeriodicAverager`.

    Every rank of the default group must construct it, in the same order relative to other
    group creations (the subgroups are made with `dist.new_subgroups_by_enumeration`).
    """

    def __init__(
        self,
        period_group_size_dict: dict[int, int] | None = None,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: torch.nn.Module | None = None,
        stats: CommStats | None = None,
        comm_dtype: str | torch.dtype = torch.float32,
        link: SimulatedLink | None = None,
        init_sync: bool | None = None,
        error_feedback: bool = False,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback_decay: float = 1.0,
        drop_nonfinite: bool = True,
        round_starts: bool = False,
        schedule: ConstantPeriod | None = None,
    ):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        world = Communicator(process_group, stats, link, guard=drop_nonfinite)
        check_levels(period_group_size_dict or {}, world.size)
        by_size: dict[int, Communicator] = {}  # one set of subgroups per distinct size
        levels = []
        for size in period_group_size_dict.values():
            if size not in by_size:
                by_size[size] = world.subgroups(size)
            levels.append(by_size[size])
        self.periods = list(period_group_size_dict)
        self.period_process_group_dict = OrderedDict(
            (period, comm.group if comm.group is not None else dist.group.WORLD)
            for period, comm in zip(self.periods, levels, strict=True)
        )
        self.comm_dtype = comm_dtype_of(comm_dtype, quant_block_size)
        lossy = self.comm_dtype != torch.float32
        if lossy:
            sizes = list(period_group_size_dict.values())
            if sizes != sorted(sizes):
                raise ValueError("comm_dtype other than float32 needs group sizes that only grow")
        dtype, n = self.comm_dtype, len(levels)

        def make_rounds(flat: FlatBuffers) -> Rounds:
            # below fp32 each level's change is sent from the values every member of its
            # group shared after their last sync at that level or wider: one anchor set a level
            return Rounds(
                flat,
                [whole(flat)],
                size=world.size,
                contribution="change" if lossy else "values",
                fmt=dtype,
                levels=n,
                error_feedback=error_feedback,
                feedback_decay=error_feedback_decay,
                anchored=round_starts,
            )

        super().__init__(
            levels,
            process_group,
            module=module,
            rounds=make_rounds,
            warmup_steps=warmup_steps,
            init_sync=init_sync,
            schedule=schedule if schedule is not None else ConstantPeriod(self.periods[-1]),
        )

    def period_of(self, level: int) -> int:
        if level == len(self.periods) - 1 and self.schedule.varies:
            return self.schedule.period_at(self.step)
        return self.periods[level]

    def round_at(self, step: int) -> tuple[int, int] | None:
        """torch's rule; with a varying `schedule` the widest level averages once its period
        has passed since its last average, and the inner levels by torch's rule between."""
        periods = self.periods
        if self.schedule.varies:
            if step >= self.warmup_steps and (
                step - self.last_average >= self.schedule.period_at(step)
            ):
                return 0, len(periods) - 1
            periods = periods[:-1]
        level = level_by_period(step, self.warmup_steps, periods)
        return None if level is None else (0, level)

    def next_sync(self, step: int) -> int:
        s = max(step, self.warmup_steps)
        while not self.averages_all(s):  # within the last period: it divides some s ahead
            s += 1
        return s

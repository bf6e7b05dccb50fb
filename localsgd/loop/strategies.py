"""The trainer's synchroniser, built from the `sync` config in one place.

`sync.levels` gives a `HierarchicalAverager`; `sync.outer` (diloco | slowmo) an `OuterAverager`;
otherwise a `PeriodicAverager`, each with the period schedule, the communication precision and
the optimizer-state policy the config names. `localsgd.config.validate` has already refused bad
combinations; the averagers check their own arguments again.
"""

from __future__ import annotations

from typing import Any

import torch

from localsgd.averaging import (
    OUTER_DEFAULTS,
    AdaptivePeriod,
    Averager,
    CommStats,
    ConstantPeriod,
    HierarchicalAverager,
    OptimizerStateSync,
    OuterAverager,
    PeriodicAverager,
    SimulatedLink,
    StepPeriod,
)
from localsgd.config import SyncConfig


def _or(value: Any, default: Any) -> Any:
    """A nullable setting: null means the method's default."""
    return default if value is None else value


def resolve_group_size(value: Any, world_size: int, local_world_size: int) -> int:
    """A level's `group_size`: an integer, `world` (every rank) or `node` (torchrun's
    LOCAL_WORLD_SIZE: the processes on one machine)."""
    if value == "world":
        return world_size
    if value == "node":
        return local_world_size
    return int(value)


def build_schedule(sync: SyncConfig) -> ConstantPeriod:
    name = sync.schedule
    if name == "step":
        return StepPeriod(sync.period, sync.period_factor, list(sync.period_milestones))
    if name == "adaptive":
        return AdaptivePeriod(
            sync.period,
            min_period=sync.min_period,
            max_period=sync.max_period,
            factor=sync.period_factor,
            tolerance=sync.adaptive_tolerance,
        )
    return ConstantPeriod(sync.period)


def build_averager(
    sync: SyncConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world_size: int,
    local_world_size: int,
    stats: CommStats,
    link: SimulatedLink | None = None,
) -> Averager:
    """The averager the `sync` config asks for, its optimizer-state hook attached; a simulated
    slow `link` applies to every collective it makes."""
    comm_dtype = sync.comm_dtype
    levels = list(sync.levels)
    outer = sync.outer
    if levels:
        sizes = {
            int(lv.period): resolve_group_size(lv.group_size, world_size, local_world_size)
            for lv in levels
        }
        averager = HierarchicalAverager(
            sizes, sync.warmup_steps, module=model, stats=stats, comm_dtype=comm_dtype, link=link
        )
    elif outer != "none":
        defaults = OUTER_DEFAULTS[outer]
        averager = OuterAverager(
            sync.period,
            sync.warmup_steps,
            module=model,
            stats=stats,
            outer_lr=_or(sync.outer_lr, defaults["lr"]),
            outer_momentum=_or(sync.outer_momentum, defaults["momentum"]),
            outer_nesterov=_or(sync.outer_nesterov, defaults["nesterov"]),
            schedule=build_schedule(sync),
            comm_dtype=comm_dtype,
            link=link,
        )
    else:
        averager = PeriodicAverager(
            sync.period,
            sync.warmup_steps,
            module=model,
            stats=stats,
            schedule=build_schedule(sync),
            comm_dtype=comm_dtype,
            link=link,
            overlap=sync.overlap,
            bucket_mb=sync.bucket_mb,
        )
    mode = sync.optimizer_state
    if mode != "local":
        averager.hooks.append(OptimizerStateSync(optimizer, mode))
    return averager

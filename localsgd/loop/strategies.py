"""The trainer's synchroniser, built from the `sync` config in one place.

`sync.levels` gives a `HierarchicalAverager`; `sync.outer` (diloco | slowmo) an `OuterAverager`;
otherwise a `PeriodicAverager`, each with the period schedule, the communication precision and
the optimizer-state policy the config names. `localsgd.config.validate` has already refused bad
combinations; the averagers check their own arguments again.
"""

from __future__ import annotations

from collections.abc import Callable
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


# A level's `group_size` may name one of these instead of an integer.
GROUP_SIZE_WORDS = ("node", "world")


def resolve_group_size(value: Any, world_size: int, local_world_size: int | None) -> int:
    """A level's `group_size`: an integer, `world` (every rank) or `node` (torchrun's
    LOCAL_WORLD_SIZE: the processes on one machine; without it, every rank)."""
    if value == "world":
        return world_size
    if value == "node":
        return world_size if local_world_size is None else local_world_size
    return int(value)


SCHEDULES: dict[str, Callable[[SyncConfig], ConstantPeriod]] = {
    "constant": lambda sync: ConstantPeriod(sync.period),
    "step": lambda sync: StepPeriod(sync.period, sync.period_factor, list(sync.period_milestones)),
    "adaptive": lambda sync: AdaptivePeriod(
        sync.period,
        min_period=sync.min_period,
        max_period=sync.max_period,
        factor=sync.period_factor,
        tolerance=sync.adaptive_tolerance,
    ),
}

# `sync.outer`: none, or an outer optimizer with the papers' defaults
OUTERS = ("none", *OUTER_DEFAULTS)


def build_schedule(sync: SyncConfig) -> ConstantPeriod:
    return SCHEDULES[sync.schedule](sync)


def strategy_name(sync: SyncConfig) -> str:
    """The averaging strategy the `sync` config runs, named as its conf/sync/ preset (read from
    what the config does, so `sync.outer=diloco` on the command line is labelled diloco too;
    wandb's `job_type`). The most specific feature wins: levels, an outer optimizer, an adaptive
    period, a synchronous warmup, then k=1 or plain local SGD."""
    if sync.levels:
        return "hierarchical"
    if sync.outer != "none":
        return sync.outer
    if sync.schedule == "adaptive":
        return "adaptive"
    if sync.warmup_steps > 0:
        return "post_local_sgd"
    return "sync_sgd" if sync.period == 1 else "local_sgd"


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

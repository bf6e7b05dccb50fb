"""The checks of `dist.shard_size` (sharded replica groups, `localsgd.loop.sharding`): a divisor
of the world size, and, above 1, a one-line refusal of every setting not built sharded yet
(what the sync keys mean is read by `localsgd.loop.plan.SyncPlan.shard_refusal`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan

# key: (the value a sharded run needs, what the key would ask of it); the recipe's precision,
# compile, clipping, accumulation and activation checkpointing are built (localsgd/loop/recipe.py)
SHARD_NEEDS = {
    "ft.backend": ("none", "fault tolerance across sharded replica groups"),
    "trainer.nan_policy": ("error", "a rank of a replica group skipping a step alone"),
}

NOT_YET = "is not built with dist.shard_size > 1 yet"


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def validate_sharding(
    cfg: Any, get: Callable[[Any, str], Any], ws: int | None, local: int | None = None
) -> None:
    """Raise ConfigError unless `dist.shard_size` divides the `ws` workers (None: not known
    yet) and the `local` ones of a machine (torchrun's LOCAL_WORLD_SIZE; None: one machine),
    and, above 1, every other setting is one built sharded."""
    size = get(cfg, "dist.shard_size")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ConfigError(f"dist.shard_size must be an integer >= 1, got {size!r}")
    if ws is not None and ws % size:
        raise ConfigError(
            f"dist.shard_size must be a divisor of the world size ({ws} workers), got {size}"
        )
    if local is not None and local % size:
        # a group is S contiguous ranks and torchrun numbers each machine's contiguously: only
        # a divisor keeps every group on one machine, else FSDP's per-step gathers and
        # reduce-scatters would cross the network
        raise ConfigError(
            f"dist.shard_size must be a divisor of the workers per machine ({local}, "
            f"LOCAL_WORLD_SIZE), got {size}: a replica group would span machines"
        )
    if size == 1:
        return
    refusal = SyncPlan.of(get(cfg, "sync")).shard_refusal()
    if refusal is not None:
        raise ConfigError(f"{refusal} {NOT_YET}")
    for key, (needed, what) in SHARD_NEEDS.items():
        value = get(cfg, key)
        if value != needed:
            raise ConfigError(
                f"{key}={_shown(value)} ({what}) {NOT_YET}; set {key}={_shown(needed)}"
            )

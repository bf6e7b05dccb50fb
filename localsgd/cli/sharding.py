"""The checks of `dist.shard_size` (sharded replica groups, `localsgd.loop.fsdp`): a divisor
of the world size and of a machine's workers, and the same as a machine's workers under torchft
(what it does not combine with is a row of `localsgd.cli.refusals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.config import ConfigError

MUON_TARGET = "localsgd.loop.muon.MuonAdamW"  # optim=muon


def validate_sharding(
    cfg: Any, get: Callable[[Any, str], Any], ws: int | None, local: int | None = None
) -> None:
    """Raise ConfigError unless `dist.shard_size` divides the `ws` workers (None: not known
    yet) and the `local` ones of a machine (torchrun's LOCAL_WORLD_SIZE; None: one machine)."""
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
    if size > 1 and get(cfg, "ft.backend") != "none":
        _validate_ft(cfg, get, size, ws)


def _validate_ft(cfg: Any, get: Callable[[Any, str], Any], size: int, ws: int | None) -> None:
    """ft=torchft with sharding: each machine (a torchrun) is one replica group, sharded with
    FSDP2 over all its ranks, and torchft connects rank r of every group, which holds the same
    shard. On one machine each worker is a replica group of one process: nothing to shard."""
    from localsgd.cli.forkserver import under_torchrun

    if not under_torchrun():  # a row of the refusals (one machine: one process a group)
        return
    # Equal, not a divisor: with fewer ranks per shard than per machine, a shard's replicas
    # inside the machine would need their own average under torchft's, not built
    if ws is not None and size != ws:
        raise ConfigError(
            f"dist.shard_size must equal the ranks per machine ({ws}, torchrun's "
            f"--nproc-per-node) with ft=torchft: each machine is one sharded replica group, "
            f"got {size}"
        )

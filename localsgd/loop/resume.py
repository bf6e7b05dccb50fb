"""Which loader continues a checkpoint, whoever wrote it, and the line that says what changed.

- a shared checkpoint of a sharded run (one replica group's state, under `ft=torchft`):
  `localsgd.loop.checkpoint_shared`;
- a sharded run's own (one DCP save of every group): `localsgd.loop.checkpoint_dcp.resume`;
- an unsharded run's, continued sharded: `localsgd.loop.checkpoint_dcp.resume_unsharded`;
- an unsharded run's (one state per worker, or a shared one), continued unsharded:
  `localsgd.loop.reshard.resume`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from localsgd.loop import checkpoint_dcp, checkpoint_shared, reshard
from localsgd.loop.checkpoint import Stateful, _marker


def _shared_sharded(folder: str) -> bool:
    return checkpoint_dcp.is_sharded(folder) and bool(_marker(folder).get("shared"))


def resume_run(
    folder: str,
    info,
    shard_size: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore worker `info.rank` of `info.world_size` (groups of `shard_size`) from a verified
    checkpoint, whoever wrote it (module docstring). Returns the step."""
    rank, world = info.rank, info.world_size
    args = (device, components, optional)
    if _shared_sharded(folder):
        return checkpoint_shared.resume_shared(folder, rank, world, shard_size, *args)
    if checkpoint_dcp.is_sharded(folder):
        return checkpoint_dcp.resume(folder, rank, world, shard_size, *args)
    if shard_size > 1:
        return checkpoint_dcp.resume_unsharded(folder, rank, world, shard_size, *args)
    return reshard.resume(folder, info, *args)


def resume_line(folder: str, world_size: int, shard_size: int) -> str | None:
    """The launcher's line for `world_size` workers in groups of `shard_size` continuing
    `folder`: what they start from and what changed; None when every rank takes its own."""
    if _shared_sharded(folder):
        return checkpoint_shared.shared_resume_line(folder, world_size)
    if checkpoint_dcp.is_sharded(folder) or shard_size > 1:
        return checkpoint_dcp.resume_line(folder, world_size, shard_size)
    return reshard.resume_line(folder, world_size)

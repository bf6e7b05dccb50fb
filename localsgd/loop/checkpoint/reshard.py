"""Resuming: any complete checkpoint, continued by any world size and shard size.

With the layout that wrote it (the same world size and shard size, one state per rank) every
rank reads back exactly its own state. Otherwise, or from a shared checkpoint (one state for
every worker, under ft=torchft), each component moves its own state to the new layout
(`localsgd.loop.checkpoint.state`): the step, the strategy's shared state (the averager's
counters and schedule, DiLoCo's/SlowMo's anchor and outer momentum) and the loop's bookkeeping
are the first old worker's, the same on every worker. The model every new worker starts from:

- taken at a global sync, where every worker holds the same averaged model: that model;
- taken between syncs, plain averaging (and anything without an outer step): the mean of the old
  workers' models, parameters and floating-point buffers (summed in rank order, divided once;
  integer buffers are rank 0's), i.e. the average the next sync would have started from;
- taken between syncs with an outer step (`sync.outer`, DiLoCo/SlowMo): the anchor, the model of
  the last outer step, the same on every worker. The local steps since that sync are dropped (the
  resume line counts them), while the step, the LR schedule and the data go on from the
  checkpoint. Not one extra outer step at resume: it would be taken on a pseudo-gradient of a
  part of a round, at a step where the schedule has none, advancing the outer warmup and
  momentum by a round the run never had; and the anchor is what the outer step defines as the
  global model, what a torchft rollback also returns to. At most `sync.period` - 1 steps are lost.

What differs per worker is carried over so: the inner optimizer state is the old workers' mean
(element-wise; step counts are the first's); the data is re-partitioned deterministically over
the new world size, each worker continuing its new shard at the old workers' epoch and at the
same fraction of it; a rank that existed keeps its random generators, a new rank starts from its
per-rank seed; error-feedback residuals as `localsgd.loop.checkpoint.averager_state` says.

Sharded checkpoints (`localsgd.loop.checkpoint.dcp`) follow the same rules: DCP reshards the
model and the optimizer on load and the averager's flat state is cut to the new shards; an
unsharded run's checkpoint continues sharded (its whole states merged, then sharded on load);
a shared sharded one (one replica group's) continues with any number of groups of its shard size.

What cannot be carried over is refused before any worker starts
(`localsgd.loop.plan.SyncPlan.reshard_refusal`): averages in flight (overlap, delayed or eager
merges, fragments), and robust or scored rounds.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from localsgd.loop.checkpoint import dcp
from localsgd.loop.checkpoint.folders import rank_file, rank_states, read_marker, written_by
from localsgd.loop.checkpoint.state import Reshard, Stateful, resharded, restore


def _at_sync(state: dict) -> bool:
    return bool(state.get("loop", {}).get("in_sync", False))


def _outer(state: dict) -> bool:
    """Whether a rank state's averager takes an outer step over an anchor (`sync.outer`)."""
    rounds = state.get("averager", {}).get("rounds", {})
    return isinstance(rounds, dict) and "anchors" in rounds and "optimizers" in rounds


def _steps_since_sync(state: dict) -> int | None:
    """Local steps a rank state took after the last average (0 at a sync); None where the
    averager does not record it (hierarchical levels)."""
    step = int(state["step"])
    last = state.get("averager", {}).get("last_average")  # the averager's index of that step
    if last is None:
        return None
    return min(step, max(0, step - (int(last) + 1)))


def _load(folder: str, rank: int, device) -> dict:
    return torch.load(rank_file(folder, rank), map_location=device, weights_only=True)


def needs_reshard(folder: str, world_size: int) -> bool:
    """Whether `world_size` unsharded workers continue an unsharded `folder` resharded:
    written by another world size, or shared (one state for every worker)."""
    return rank_states(folder) != world_size or written_by(folder) != world_size


def resume(
    folder: str,
    info,
    shard_size: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore worker `info.rank` of `info.world_size` (groups of `shard_size`) from a verified
    checkpoint, whoever wrote it: its own state when the same layout wrote one per rank, else
    moved (the module docstring). Every rank calls this (DCP's loads are collective). Returns
    the step."""
    rank, world = info.rank, info.world_size
    marker = read_marker(folder)
    old_shards = int(marker.get("shard_size", 1))
    if rank_states(folder) == world == written_by(folder) and old_shards == shard_size:
        skip: tuple[str, ...] = ()
        if old_shards > 1:  # the model and the optimizer exactly as this rank's group saved them
            dcp.load_own_group(folder, rank // shard_size, components)
            skip = dcp.SHARDED
        state = _load(folder, rank, device)
        restore(state, components, (*optional, *skip), folder)
        return int(state["step"])
    return load_resharded(folder, rank, device, components, optional, world, shard_size)


def load_resharded(
    folder: str,
    rank: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
    world_size: int | None = None,
    shard_size: int = 1,
) -> int:
    """Restore `components` for rank `rank` of `world_size` workers (groups of `shard_size`)
    from a checkpoint of another layout, or from a shared checkpoint: each component moves its
    own state (the module docstring). Returns the step."""
    marker = read_marker(folder)
    old_shards, shared = int(marker.get("shard_size", 1)), bool(marker.get("shared"))
    if shared and old_shards > 1 and old_shards != shard_size:  # refused before (preflight)
        raise ValueError(f"{folder} holds shards of {old_shards} ranks, not {shard_size}")
    states = [_load(folder, r, device) for r in range(rank_states(folder))]
    reshard = Reshard(
        folder=folder,
        rank=rank,
        world_size=world_size or len(states),
        shard_size=shard_size,
        old_world=written_by(folder),
        old_shards=old_shards,
        shared=shared,
        at_sync=_at_sync(states[0]),
        outer=_outer(states[0]),
        device=device,
    )
    sharded = dcp.SHARDED if old_shards > 1 else ()  # not in the rank files: DCP's
    merged, kept = resharded(states, components, reshard, skip=sharded)
    if old_shards > 1 and shared:  # one replica group's: every group takes it
        dcp.load_own_group(folder, 0, components)
    elif old_shards > 1:
        dcp.load_resharded(folder, reshard, components)
    elif shard_size > 1:  # whole states, sharded on load
        dcp.load_whole(merged.pop("model"), merged.pop("optimizer"), components)
        sharded = dcp.SHARDED
    restore(merged, components, (*optional, *sharded, *kept), folder)
    for component in components.values():  # e.g. the anchor as the model (between syncs)
        if hasattr(component, "after_reshard"):
            component.after_reshard(reshard)
    return int(states[0]["step"])


def resume_line(folder: str, world_size: int, shard_size: int = 1) -> str | None:
    """The launcher's line for `world_size` workers in groups of `shard_size` continuing
    `folder`: what they start from and what changed; None when every rank takes its own."""
    marker = read_marker(folder)
    old_shards = int(marker.get("shard_size", 1))
    if old_shards > 1 and marker.get("shared"):
        return _shared_sharded_line(marker, world_size)
    if old_shards > 1 or shard_size > 1:
        return _layout_line(folder, marker, world_size, shard_size)
    return _world_line(folder, world_size)


def _world_line(folder: str, world_size: int) -> str | None:
    """Unsharded workers continuing an unsharded checkpoint."""
    if not needs_reshard(folder, world_size):
        return None
    before, shared = written_by(folder), rank_states(folder) == 1 and written_by(folder) > 1
    optimizer = (
        "the optimizer state of the worker that wrote it"
        if shared
        else "the old workers' average optimizer state"
    )
    where = "at another world size" if before != world_size else "every worker"
    state = torch.load(rank_file(folder, 0), map_location="cpu", weights_only=True, mmap=True)
    if shared or _at_sync(state):
        return (
            f"resuming {where}: {before} workers' averaged model, step, outer state and "
            f"schedule continue with {world_size}, each with {optimizer}; the data is "
            f"re-partitioned"
        )
    since, step = _steps_since_sync(state), int(state["step"])
    workers = f"{world_size} worker{'s' if world_size != 1 else ''}"
    if _outer(state):
        start = (
            f"the model of the last outer step (the anchor, the same on every worker), dropping "
            f"the {'' if since is None else f'{since} '}local steps since; the step ({step}), "
            f"the LR schedule, the outer state and the data go on from the checkpoint"
        )
    else:
        start = (
            f"the mean of the {before} workers' models; the step, the averager's state and the "
            f"schedule continue"
        )
    return (
        f"resuming {where}: the checkpoint was taken "
        f"{'between syncs' if since is None else f'{since} local steps after the last sync'}, "
        f"so {workers} start from {start}, each worker with {optimizer}; the data is "
        f"re-partitioned"
    )


def _layout_line(folder: str, marker: dict, world_size: int, shard_size: int) -> str | None:
    """A sharded checkpoint continued with another layout, or an unsharded one sharded."""
    old_world, old_shards = int(marker["world_size"]), int(marker.get("shard_size", 1))
    if (old_world, old_shards) == (world_size, shard_size):
        return None
    old_groups, groups = old_world // old_shards, world_size // shard_size
    state = torch.load(rank_file(folder, 0), map_location="cpu", weights_only=True, mmap=True)
    if _at_sync(state):
        start = "the averaged model"
    elif _outer(state):
        since = _steps_since_sync(state)
        start = (
            f"the model of the last outer step (the anchor), dropping the "
            f"{'' if since is None else f'{since} '}local steps since"
        )
    else:
        start = f"the mean of the {old_groups} groups' models"
    return (
        f"resuming with another layout: {old_groups} group(s) of {old_shards} become {groups} "
        f"group(s) of {shard_size} (the model and the optimizer resharded on load, the "
        f"averager's flat state cut to the new shards); they start from {start}, with the old "
        f"groups' mean optimizer state; the step, the schedule and the averager's state go on "
        f"from the checkpoint" + ("" if old_world == world_size else "; the data is re-partitioned")
    )


def _shared_sharded_line(marker: dict, world_size: int) -> str:
    """Every replica group continuing one group's shared checkpoint (under ft=torchft)."""
    old_world, shards = int(marker["world_size"]), int(marker["shard_size"])
    old_groups, groups = old_world // shards, world_size // shards
    return (
        f"resuming every replica group from one group's shared checkpoint: {old_groups} "
        f"group(s) of {shards}'s averaged model, step, outer state and schedule continue with "
        f"{groups} group(s) of {shards}, each rank with the optimizer state of the writer's rank "
        f"that held its shard" + ("" if old_world == world_size else "; the data is re-partitioned")
    )

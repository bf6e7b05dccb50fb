"""Shared checkpoints of sharded replica groups (`ft=torchft` with `dist.shard_size` = S > 1).

Under ft a checkpoint is one shared state: right after a committed round every replica group
holds the same model, so one group's state is the job's (`checkpoint.save_shared` for groups of
one process). Sharded, no process holds that state whole: the group that led the round (its S
ranks, agreed on it by one broadcast from the group's rank 0,
`FaultTolerance.writes_checkpoint`) writes it together, in `checkpoint_dcp`'s layout of one group:

- `dcp/`: the group's model and optimizer state dicts under `group0`, one DCP save over the
  group's process group (under torchrun the default one is exactly the replica group, so the
  save is the group's collective; the other groups do not take part);
- `rank-r.pt` for r < S: the group's rank r's own state less the model and optimizer (its
  shard's anchors and outer momentum, the loop state, counters, sampler, RNG);
- `COMPLETE`: `shared: true`, `shard_size`, the job's `world_size` and which replica `group`
  wrote it, with the sizes of every file (`checkpoint.verify`).

Every rank of every group saves beside it what is its own, its error-feedback residuals
(`checkpoints/own/step-N/rank-R.pt`, by global rank). The folder is written under a temporary
name and renamed into place: where several groups race to write the same step (the stop after
a lost quorum, written by every surviving group), one folder wins whole.

Resume: every rank of every group (each torchrun, or every worker without ft) loads the same
folder: DCP reads `group0` onto its layout, and rank R takes rank R mod S's file, its own
residuals, the data position of the writer's rank (rescaled to its own shard) and, in the first
group, the writer's RNG (the others keep their per-rank seed, as `localsgd.loop.reshard` does for
an unsharded shared checkpoint). Any number of groups continues it; the shard size stays S.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from localsgd.loop.checkpoint import (
    _PREFIX,
    Stateful,
    _marker,
    checkpoint_root,
    load_own,
    publish,
    rank_file,
    restore,
    step_dir,
)
from localsgd.loop.checkpoint_dcp import SHARDED, load_group, marker_of, write_states


def save_shared(
    run_dir: str,
    step: int,
    world_size: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
    *,
    shard_size: int,
    group: int,
) -> str:
    """The writing replica group's S ranks call this together (a broadcast, DCP's collectives
    and a barrier over the group's process group): the one state every group holds, as the
    checkpoint of a job of `world_size` workers, written by replica group `group`. Returns the
    folder; if another group wrote this step first, that folder is kept and this one dropped."""
    rank = dist.get_rank()  # in the replica group
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    # one temporary folder for the group (not a listed step), named by its rank 0: the group's
    # index keeps groups on other machines (whose pids may be the same) apart
    name = [f".{_PREFIX}{step}.group{group}.tmp{os.getpid()}"]
    dist.broadcast_object_list(name, src=0)
    tmp = os.path.join(root, name[0])
    os.makedirs(tmp, exist_ok=True)
    write_states(tmp, step, rank, components, 0)
    dist.barrier()  # every rank's file and DCP's are in place before the marker exists
    folder = step_dir(run_dir, step)
    if rank != 0:
        return folder
    marker = marker_of(tmp, step, world_size, shard_size, shard_size, components, config)
    marker.update(shared=True, group=group)
    return publish(tmp, folder, marker, run_dir, keep)  # another group's may win whole


def _own_residuals(folder: str, rank: int, world_size: int, shard_size: int, device):
    """The error-feedback residuals rank `rank` resumes with, from the ranks' own files beside
    the checkpoint: at the same number of groups its own; otherwise (or where its file is
    missing) the same shard's residuals of the old groups summed over their number, on every
    new group (`localsgd.loop.reshard.residuals_for`). None when no rank saved one."""
    from localsgd.loop.reshard import residuals_for

    old_world = int(_marker(folder)["world_size"])
    shard = rank % shard_size
    own = {
        r // shard_size: state["residuals"]
        for r, state in load_own(folder, device).items()
        if r % shard_size == shard
    }
    if not own:
        return None
    groups, old_groups = world_size // shard_size, old_world // shard_size
    residuals, _ = residuals_for(rank // shard_size, groups, old_groups, own)
    return residuals


def resume_shared(
    folder: str,
    rank: int,
    world_size: int,
    shard_size: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore rank `rank` of `world_size` workers in groups of `shard_size` from a shared
    sharded checkpoint (module docstring); every rank of the process group calls this (DCP's
    load is collective). Returns the step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from localsgd.loop.reshard import _rescaled_position, _with_residuals

    old_shards = int(_marker(folder)["shard_size"])
    if old_shards != shard_size:  # refused before any worker starts (preflight)
        raise ValueError(f"{folder} holds shards of {old_shards} ranks, not {shard_size}")
    model, optimizer = components["model"].module, components["optimizer"]
    model_state, optim_state = get_state_dict(model, optimizer)
    load_group(folder, 0, {"model": model_state, "optimizer": optim_state})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    state = torch.load(rank_file(folder, rank % shard_size), map_location=device, weights_only=True)
    rest = {k: v for k, v in state.items() if k not in SHARDED}
    rounds = rest.get("averager", {}).get("rounds")
    if isinstance(rounds, dict) and rounds.get("residuals") is not None:
        # the writer's residuals are its own: each rank takes its own, saved beside
        residuals = _own_residuals(folder, rank, world_size, shard_size, device)
        rest = _with_residuals(rest, residuals)
    if "sampler" in components:
        rest["sampler"] = _rescaled_position(state["sampler"], components["sampler"].state_dict())
    if rank >= shard_size:  # only the first group takes the writer's random generators
        rest.pop("rng", None)
    restore(rest, components, (*optional, *SHARDED, "rng"), folder)
    return int(state["step"])


def shared_resume_line(folder: str, world_size: int) -> str:
    """The launcher's line when a run continues a shared sharded checkpoint."""
    marker = _marker(folder)
    old_world, shards = int(marker["world_size"]), int(marker["shard_size"])
    old_groups, groups = old_world // shards, world_size // shards
    return (
        f"resuming every replica group from one group's shared checkpoint: {old_groups} "
        f"group(s) of {shards}'s averaged model, step, outer state and schedule continue with "
        f"{groups} group(s) of {shards}, each rank with the optimizer state of the writer's rank "
        f"that held its shard" + ("" if old_world == world_size else "; the data is re-partitioned")
    )

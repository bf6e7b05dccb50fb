"""Checkpoints of sharded runs (`dist.shard_size` > 1): the model's and the optimizer's sharded
state through torch.distributed.checkpoint (DCP), the rest per rank, in the `step-N/` layout of
`localsgd.loop.checkpoint`.

Layout of `checkpoints/step-N/`:

- `dcp/`: one DCP save of every replica group's model and optimizer state dicts (FSDP2's DTensor
  state dicts, `get_state_dict`), each group under its own key `group{g}`: between syncs the
  groups hold different models, so DCP must not deduplicate one group's shards against another's
  (it keeps one copy of equal keys). At a sync the groups' copies are equal; that costs G copies
  of the model on disk, the price of exact resume between syncs.
- `rank-R.pt`: each rank's own state as in unsharded checkpoints, less the model and optimizer:
  the averager (counters, and its anchors, outer momentum and residuals as flat buffers of this
  rank's local shards), the sampler, RNG, loop state and counters.
- `COMPLETE`: written by rank 0 after a barrier, once every rank's file and DCP's are in place,
  with `shard_size` (what marks the checkpoint as sharded), the sizes of the rank files and of
  DCP's files (`dcp_files`, checked by `checkpoint.verify`). Without it the folder is never used.

Resuming with the same world size and shard size restores every rank exactly. Another layout
(shard size, number of groups, or both, down to an unsharded run) is resharded: DCP reshards the
model and optimizer on load; the averager's flat buffers are cut back into each parameter's
shards (FSDP2 shards dim 0 in `torch.chunk` pieces), joined whole and cut again for the new
layout (`relayout`). What the new groups start from follows `localsgd.loop.reshard`: at a sync
the averaged model (group 0's, the same in every group); between syncs with an outer step the
anchor; between syncs without one the mean of the old groups' models. The inner optimizer state
is the old groups' mean; error-feedback residuals are the old groups' sum over the old number of
groups, on every new group. An unsharded run's checkpoint resumes sharded the same way
(`resume_unsharded`). A *shared* sharded checkpoint, one replica group's state written under
`ft=torchft`, is `localsgd.loop.checkpoint_shared`'s; `localsgd.loop.resume` picks the loader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from localsgd.loop.checkpoint import (
    MARKER,
    Stateful,
    _marker,
    _write_atomic,
    prune,
    rank_file,
    restore,
    step_dir,
)
from localsgd.loop.relayout import averager_state, by_name, from_anchor, fsdp_units

DCP_DIR = "dcp"
# the model and optimizer go through DCP; every other component through the rank file
SHARDED = ("model", "optimizer")


def is_sharded(folder: str) -> bool:
    """Whether a (verified) checkpoint folder was written by a sharded run."""
    return int((_marker(folder) or {}).get("shard_size", 1)) > 1


def _module(components: Mapping[str, Stateful]) -> torch.nn.Module:
    return components["model"].module  # checkpoint.ModuleState


def write_states(
    folder: str, step: int, rank: int, components: Mapping[str, Stateful], group: int
) -> None:
    """This rank's part of a sharded checkpoint in `folder`: its shards of the model and the
    optimizer through DCP under the key `group{group}` (a collective of the default process
    group), and the rest of its state in `rank-R.pt`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(_module(components), components["optimizer"])
    dcp.save(
        {f"group{group}": {"model": model_state, "optimizer": optim_state}},
        checkpoint_id=os.path.join(folder, DCP_DIR),
    )
    state = {"step": step}
    state.update({n: c.state_dict() for n, c in components.items() if n not in SHARDED})
    _write_atomic(rank_file(folder, rank), lambda f: torch.save(state, f))


def marker_of(
    folder: str,
    step: int,
    world_size: int,
    shard_size: int,
    ranks: int,
    components: Mapping[str, Stateful],
    config: dict | None,
) -> dict:
    """The COMPLETE marker of a sharded checkpoint in `folder` holding `ranks` rank files (once
    every rank's file and DCP's are in place): the sizes `checkpoint.verify` checks."""
    files = {
        os.path.basename(rank_file(folder, r)): os.path.getsize(rank_file(folder, r))
        for r in range(ranks)
    }
    dcp_dir = os.path.join(folder, DCP_DIR)
    dcp_files = {
        f"{DCP_DIR}/{name}": os.path.getsize(os.path.join(dcp_dir, name))
        for name in sorted(os.listdir(dcp_dir))
        if not name.startswith(".") or name == ".metadata"
    }
    return {
        "step": step,
        "world_size": world_size,
        "shard_size": shard_size,
        "files": files,
        "dcp_files": dcp_files,
        # what the DCP keys were written from
        "units": fsdp_units(_module(components), _blocks_path(config)),
        "config": config,
    }


def save(
    run_dir: str,
    step: int,
    rank: int,
    world_size: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
    *,
    shard_size: int,
) -> str:
    """Every rank calls this at the same step (collectives: DCP's and a barrier); returns the
    folder."""
    folder = step_dir(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(folder, MARKER)):
        # an earlier life's marker over the files rewritten now: gone before any is (the
        # ranks meet in DCP's first collective), so a kill mid-save leaves an unmarked folder
        os.remove(os.path.join(folder, MARKER))
    write_states(folder, step, rank, components, rank // shard_size)
    dist.barrier()  # every rank's file and DCP's are in place before the marker exists
    if rank == 0:
        marker = marker_of(folder, step, world_size, shard_size, world_size, components, config)
        _write_atomic(os.path.join(folder, MARKER), lambda f: f.write(json.dumps(marker).encode()))
        prune(run_dir, keep)
    return folder


# --- loading ------------------------------------------------------------------------------------


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree


def _add_floats(total, other) -> None:
    """`total` += `other` on every floating-point tensor of more than one value (nested dicts;
    a DTensor through its local shard); step counts and the like stay `total`'s."""
    from localsgd.averaging.flat import local_tensor

    for k, v in total.items():
        if isinstance(v, dict):
            _add_floats(v, other[k])
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
            local_tensor(v).add_(local_tensor(other[k]))


def _scale_floats(tree, factor: float) -> None:
    from localsgd.averaging.flat import local_tensor

    for v in tree.values():
        if isinstance(v, dict):
            _scale_floats(v, factor)
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
            local_tensor(v).mul_(factor)


def load_group(folder: str, group: int, parts: dict) -> None:
    """Read old group `group`'s `parts` ({"model": ..., "optimizer": ...}, either or both) into
    the given state dicts, in place (DCP reshards onto their layout; a collective)."""
    import torch.distributed.checkpoint as dcp

    dcp.load({f"group{group}": parts}, checkpoint_id=os.path.join(folder, DCP_DIR))


def _mean_of_groups(folder: str, groups: int, template: dict, what: str) -> dict:
    """The old groups' mean of the `what` ("model" or "optimizer") state dict, read into
    clones of `template` (DCP reshards each onto this rank's layout); summed in group order,
    divided once."""
    total = None
    for g in range(groups):
        part = _clone(template)
        load_group(folder, g, {what: part})
        if total is None:
            total = part
        else:
            _add_floats(total, part)
    if groups > 1:
        _scale_floats(total, 1.0 / groups)
    return total


def resume(
    folder: str,
    rank: int,
    world_size: int,
    shard_size: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore rank `rank` of `world_size` workers in groups of `shard_size` from a sharded
    checkpoint: exactly when the layout is the same, else resharded (module docstring).
    Every rank calls this (DCP's loads are collective). Returns the step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from localsgd.loop.reshard import _at_sync, _outer

    marker = _marker(folder)
    old_world, old_shards = int(marker["world_size"]), int(marker["shard_size"])
    model, optimizer = _module(components), components["optimizer"]
    model_state, optim_state = get_state_dict(model, optimizer)
    if old_world == world_size and old_shards == shard_size:
        load_group(folder, rank // shard_size, {"model": model_state, "optimizer": optim_state})
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        state = torch.load(rank_file(folder, rank), map_location=device, weights_only=True)
        restore(state, components, (*optional, *SHARDED), folder)
        return int(state["step"])
    groups = old_world // old_shards
    states = [
        torch.load(rank_file(folder, r), map_location=device, weights_only=True)
        for r in range(old_world)
    ]
    between = not _at_sync(states[0])
    if between and not _outer(states[0]):
        model_state = _mean_of_groups(folder, groups, model_state, "model")
    else:  # at a sync every group holds the same model; with an outer step the anchor, below
        model_state = _mean_of_groups(folder, 1, model_state, "model")
    optim_state = _mean_of_groups(folder, groups, optim_state, "optimizer")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    layout = (rank, world_size, shard_size)
    return _restore_rest(folder, states, old_shards, layout, components, optional)


def resume_unsharded(
    folder: str,
    rank: int,
    world_size: int,
    shard_size: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore rank `rank` of a sharded run (groups of `shard_size`) from an unsharded run's
    checkpoint (one whole state per rank, `checkpoint.save`): the model and the optimizer
    state as `localsgd.loop.reshard` merges them, sharded on load (`set_state_dict` of whole
    state dicts), the averager's flat state cut to this rank's shards. Returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from localsgd.loop.reshard import _at_sync, _average_model, _average_optimizer, _outer

    old_world = int(_marker(folder)["world_size"])
    states = [
        torch.load(rank_file(folder, r), map_location=device, weights_only=True)
        for r in range(old_world)
    ]
    between = not _at_sync(states[0])
    model_state = states[0]["model"]
    if between and not _outer(states[0]):
        model_state = _average_model([s["model"] for s in states])
    model, optimizer = _module(components), components["optimizer"]
    optim_state = by_name(_average_optimizer([s["optimizer"] for s in states]), model, optimizer)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )
    layout = (rank, world_size, shard_size)
    return _restore_rest(folder, states, 1, layout, components, optional)


def _restore_rest(
    folder: str,
    states: list[dict],
    old_shards: int,
    layout: tuple[int, int, int],
    components: Mapping[str, Stateful],
    optional: tuple[str, ...],
) -> int:
    """Everything but the model and the optimizer (already loaded) for `layout` (rank, world
    size, shard size) from the old ranks' `states` (in groups of `old_shards`): rank 0's
    counters and loop state, the averager's flat state cut to this rank's shards, the data
    position and RNG; then, between syncs with an outer step, the anchor as the model. Returns
    the step."""
    from localsgd.loop.reshard import _at_sync, _outer, _rescaled_position, carry_rng

    rank, world_size, shard_size = layout
    old_world = len(states)
    averager = components["averager"]
    merged = {k: v for k, v in states[0].items() if k not in SHARDED}
    merged["averager"] = averager_state(states, old_shards, averager, shard_size, rank % shard_size)
    if old_world == world_size:  # the same data shards: each rank's own position and RNG
        merged["sampler"] = states[rank]["sampler"]
    elif "sampler" in components:
        merged["sampler"] = _rescaled_position(
            states[0]["sampler"], components["sampler"].state_dict()
        )
    carry_rng(merged, states, rank)
    restore(merged, components, (*optional, *SHARDED, "rng"), folder)
    if not _at_sync(states[0]) and _outer(states[0]):
        from_anchor(averager)
    return int(states[0]["step"])


def resume_line(folder: str, world_size: int, shard_size: int) -> str | None:
    """The launcher's line when a sharded checkpoint continues with another layout; None when
    every rank takes its own state."""
    from localsgd.loop.reshard import _at_sync, _outer, _steps_since_sync

    marker = _marker(folder)
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


def _blocks_path(config: dict | None) -> str | None:
    """dist.shard_blocks of the run's config (absent in configs from before the key)."""
    return ((config or {}).get("dist") or {}).get("shard_blocks")

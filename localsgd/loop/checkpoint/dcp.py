"""The model's and the optimizer's sharded state through torch.distributed.checkpoint (DCP), for
sharded runs (`dist.shard_size` > 1); every other component goes through the rank files.

In a sharded checkpoint's folder, `dcp/` is one DCP save of every replica group's model and
optimizer state dicts (FSDP2's DTensor state dicts, `get_state_dict`), each group under its own
key `group{g}`: between syncs the groups hold different models, so DCP must not deduplicate one
group's shards against another's (it keeps one copy of equal keys). At a sync the groups' copies
are equal; that costs G copies of the model on disk, the price of exact resume between syncs. A
shared checkpoint (one replica group's, under ft=torchft) holds `group0` only.

On load DCP reshards onto this rank's layout, whatever the old one was. What the new groups
start from follows `localsgd.loop.checkpoint.state.ModuleState`: at a sync (or with an outer
step, whose anchor then takes over) group 0's model, between syncs otherwise the mean of the old
groups'; the inner optimizer state is the old groups' mean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from localsgd.averaging.trees import add_, clone_tree, is_float_array, scale_
from localsgd.loop.checkpoint.folders import file_sizes, rank_file, save_state
from localsgd.loop.checkpoint.relayout import by_name, fsdp_units
from localsgd.loop.checkpoint.state import Reshard, Stateful

DCP_DIR = "dcp"
# the model and optimizer go through DCP; every other component through the rank file
SHARDED = ("model", "optimizer")


def _module(components: Mapping[str, Stateful]) -> torch.nn.Module:
    return components["model"].module  # ModuleState


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
    save_state(rank_file(folder, rank), state)


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
    every rank's file and DCP's are in place): the sizes `folders.verify` checks."""
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
        "files": file_sizes(folder, ranks),
        "dcp_files": dcp_files,
        # what the DCP keys were written from
        "units": fsdp_units(_module(components), blocks_path(config)),
        "config": config,
    }


def blocks_path(config: dict | None) -> str | None:
    """dist.shard_blocks of the run's config (absent in configs from before the key)."""
    return ((config or {}).get("dist") or {}).get("shard_blocks")


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
        part = clone_tree(template)
        load_group(folder, g, {what: part})
        total = part if total is None else add_(total, part, is_float_array)
    if groups > 1:
        scale_(total, 1.0 / groups, is_float_array)
    return total


def load_own_group(folder: str, group: int, components: Mapping[str, Stateful]) -> None:
    """The model and optimizer exactly as group `group` saved them (the same layout)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _module(components), components["optimizer"]
    model_state, optim_state = get_state_dict(model, optimizer)
    load_group(folder, group, {"model": model_state, "optimizer": optim_state})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def load_resharded(folder: str, reshard: Reshard, components: Mapping[str, Stateful]) -> None:
    """The model and optimizer from a sharded checkpoint of another layout: the old groups'
    mean optimizer state; group 0's model, or between syncs without an outer step the old
    groups' mean (DCP reshards each onto this rank's layout; every rank calls this)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    groups = reshard.old_world // reshard.old_shards
    model, optimizer = _module(components), components["optimizer"]
    model_state, optim_state = get_state_dict(model, optimizer)
    mean = not reshard.at_sync and not reshard.outer
    model_state = _mean_of_groups(folder, groups if mean else 1, model_state, "model")
    optim_state = _mean_of_groups(folder, groups, optim_state, "optimizer")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def load_whole(model_state: dict, optim_state: dict, components: Mapping[str, Stateful]) -> None:
    """Whole (unsharded) model and optimizer state dicts, sharded onto this rank on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, optimizer = _module(components), components["optimizer"]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=by_name(optim_state, model, optimizer),
        options=StateDictOptions(full_state_dict=True),
    )

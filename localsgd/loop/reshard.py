"""Resuming at another world size: a checkpoint written by W workers at a global sync, continued
by W' workers.

At a global sync every worker holds the same averaged model, so that model, the step, the
strategy's shared state (the averager's counters and schedule, DiLoCo's/SlowMo's anchor and outer
momentum) and the loop's bookkeeping are rank 0's. What differs per worker is carried over so:

- the inner optimizer state (momentum, Adam's moments): each new worker starts from the average
  of the old workers' states (element-wise; step counts are rank 0's, the same on every worker);
- the data: re-partitioned deterministically over the new world size (the shards are a function
  of the seed, the world size and the rank), each worker continuing its new shard at the old
  workers' epoch and at the same fraction of it;
- the random generators: a worker whose rank existed before keeps that rank's; a new rank starts
  from its per-rank seed.

What cannot be carried over is refused before any worker starts (`reshard_refusal`): per-worker
error-feedback residuals, and averages in flight (overlap, delayed or eager merges, fragments).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from localsgd.loop.checkpoint import Stateful, _marker, load, rank_file, restore


def written_by(folder: str) -> int:
    """The world size that wrote a (verified) checkpoint folder."""
    return int(_marker(folder)["world_size"])


def written_at(folder: str) -> int:
    """The step a (verified) checkpoint folder was written after."""
    return int(_marker(folder)["step"])


def rank_states(folder: str) -> int:
    """How many rank states a (verified) checkpoint folder holds: one per worker, or one for
    all (a shared checkpoint, `checkpoint.save_shared`)."""
    return len(_marker(folder)["files"])


def needs_reshard(folder: str, world_size: int) -> bool:
    """Whether `world_size` workers continue `folder` through `load_resharded`: written by
    another world size, or shared (one state for every worker)."""
    return rank_states(folder) != world_size or written_by(folder) != world_size


RESHARD_REFUSED = {  # sync key: why its per-worker state cannot move to another world size
    "sync.error_feedback": "each worker's rounding residual is its own",
    "sync.overlap": "an average is in flight at every sync",
    "sync.delay_steps": "a fragment's average is in flight",
    "sync.eager": "each worker's pseudo-gradient is carried to the next round",
    "sync.fragments": "fragments sync at different steps",
}


def reshard_refusal(get) -> str | None:
    """Why a run cannot continue at another world size (`get(key)` reads its config), or
    None."""
    for key, why in RESHARD_REFUSED.items():
        value = get(key)
        if value and not (key == "sync.fragments" and value == 1):
            return f"{key}={value!r} ({why})"
    return None


def _average_optimizer(states: list[dict]) -> dict:
    """Rank 0's optimizer state with every floating-point tensor replaced by the mean over the
    old workers (summed in rank order, divided once)."""
    merged = {"param_groups": states[0]["param_groups"], "state": {}}
    for key, first in states[0]["state"].items():
        entry = {}
        for name, value in first.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                total = value.clone()
                for other in states[1:]:
                    total.add_(other["state"][key][name])
                entry[name] = total.div_(len(states))
            else:
                entry[name] = value
        merged["state"][key] = entry
    return merged


def _rescaled_position(sampler: dict, own: dict) -> dict:
    """The old workers' epoch, at the same fraction of this worker's new shard."""
    old_n, new_n = int(sampler["num_indices"]), int(own["num_indices"])
    position = int(sampler["position"]) * new_n // max(old_n, 1)
    return {**sampler, "position": min(position, new_n), "num_indices": new_n}


def load_resharded(
    folder: str,
    rank: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore `components` for rank `rank` of a new world size from a checkpoint taken at a
    global sync by another world size, or from a shared checkpoint; returns the step."""
    old = rank_states(folder)
    states = [
        torch.load(rank_file(folder, r), map_location=device, weights_only=True) for r in range(old)
    ]
    if not states[0].get("loop", {}).get("in_sync", False):
        raise ValueError(
            f"{folder} was taken between syncs: resuming at another world size needs a "
            f"checkpoint taken at a sync"
        )
    merged = dict(states[0])
    merged["optimizer"] = _average_optimizer([s["optimizer"] for s in states])
    if "sampler" in components:
        merged["sampler"] = _rescaled_position(
            states[0]["sampler"], components["sampler"].state_dict()
        )
    if rank < old:
        merged["rng"] = states[rank]["rng"]
    else:
        merged.pop("rng", None)  # the per-rank seed the trainer set
    restore(merged, components, (*optional, "rng"), folder)
    return int(states[0]["step"])


def resume(
    folder: str,
    info,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore worker `info.rank` of `info.world_size` from a verified checkpoint: its own
    state when this world size wrote one per worker, else through `load_resharded` (another
    world size's, or a shared one, taken at a sync). Returns the step."""
    if needs_reshard(folder, info.world_size):
        return load_resharded(folder, info.rank, device, components, optional)
    return load(folder, info.rank, device, components, optional)

"""Resuming at another world size: any complete checkpoint written by W workers, continued by
W' workers.

The step, the strategy's shared state (the averager's counters and schedule, DiLoCo's/SlowMo's
anchor and outer momentum) and the loop's bookkeeping are rank 0's: the same on every worker.
The model every new worker starts from:

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

What differs per worker is carried over so:

- the inner optimizer state (momentum, Adam's moments): each new worker starts from the average
  of the old workers' states (element-wise; step counts are rank 0's, the same on every worker);
- the data: re-partitioned deterministically over the new world size (the shards are a function
  of the seed, the world size and the rank), each worker continuing its new shard at the old
  workers' epoch and at the same fraction of it;
- the random generators: a worker whose rank existed before keeps that rank's; a new rank starts
  from its per-rank seed.

What cannot be carried over is refused before any worker starts
(`localsgd.loop.plan.SyncPlan.reshard_refusal`): per-worker error-feedback residuals, and
averages in flight (overlap, delayed or eager merges, fragments).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from localsgd.loop.checkpoint import Stateful, _marker, load, load_own, rank_file, restore
from localsgd.loop.pacing import new_round


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


def _average_model(states: list[dict]) -> dict:
    """Rank 0's model state with every floating-point tensor replaced by the mean over the old
    workers (summed in rank order, divided once)."""
    merged = {}
    for name, first in states[0].items():
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            total = first.clone()
            for other in states[1:]:
                total.add_(other[name])
            merged[name] = total.div_(len(states))
        else:
            merged[name] = first
    return merged


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


def _at_sync(state: dict) -> bool:
    return bool(state.get("loop", {}).get("in_sync", False))


def resume_line(folder: str, world_size: int) -> str | None:
    """The line the launcher prints when `world_size` unsharded workers continue an unsharded
    `folder` through `load_resharded`: what they start from and what is carried over; None when
    they load their own states. Sharded: `checkpoint_dcp.resume_line`."""
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


def carry_rng(merged: dict, states: list[dict], rank: int) -> None:
    """A rank that existed keeps its random generators; a new one its per-rank seed (the one the
    trainer set: nothing is restored)."""
    if rank < len(states):
        merged["rng"] = states[rank]["rng"]
    else:
        merged.pop("rng", None)


def _rescaled_position(sampler: dict, own: dict) -> dict:
    """The old workers' epoch, at the same fraction of this worker's new shard."""
    old_n, new_n = int(sampler["num_indices"]), int(own["num_indices"])
    position = int(sampler["position"]) * new_n // max(old_n, 1)
    return {**sampler, "position": min(position, new_n), "num_indices": new_n}


def _tree_sum(trees: list):
    """The element-wise sum of nested lists of tensors (None where a tree has none), in order."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        total = first.clone()
        for other in trees[1:]:
            total.add_(other)
        return total
    if isinstance(first, (list, tuple)):
        return [_tree_sum([t[i] for t in trees]) for i in range(len(first))]
    return first


def _tree_scale(tree, factor: float):
    if isinstance(tree, torch.Tensor):
        return tree.mul_(factor)
    if isinstance(tree, list):
        return [_tree_scale(t, factor) for t in tree]
    return tree


def residuals_for(
    rank: int, world_size: int, written_by: int, own: dict[int, object]
) -> tuple[object, str]:
    """The error-feedback residuals rank `rank` of `world_size` workers resumes with, from the
    old workers' own residuals `own` (by rank, of `written_by` workers), and what was done.

    At the same world size each worker takes its own. Otherwise every new worker takes the sum
    of the old residuals divided by the old world size: the next average adds sum/W' of the new
    residuals, i.e. sum/W of the old ones, exactly what the old workers' next average would have
    added. So the errors stay delayed, never lost and never counted twice. A worker whose own
    file is missing (it died before writing it) loses its residual, and the line says so."""
    if world_size == written_by and rank in own:
        return own[rank], "each worker its own residual"
    present = sorted(own)
    total = _tree_scale(_tree_sum([own[r] for r in present]), 1.0 / written_by)
    lost = written_by - len(present)
    what = f"the {written_by} workers' residuals summed over {written_by}, on every worker"
    return total, what + (f" ({lost} worker(s)' residuals missing, lost)" if lost else "")


def _with_residuals(state: dict, residuals) -> dict:
    rounds = state["averager"]["rounds"]
    return {**state, "averager": {**state["averager"], "rounds": {**rounds,
            "residuals": residuals}}}  # fmt: skip


def load_resharded(
    folder: str,
    rank: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
    world_size: int | None = None,
) -> int:
    """Restore `components` for rank `rank` of a new world size from a checkpoint of another
    world size, or from a shared checkpoint; returns the step. Between syncs the model is the
    old workers' mean, or with an outer step the anchor (see the module's docstring)."""
    old = rank_states(folder)
    states = [
        torch.load(rank_file(folder, r), map_location=device, weights_only=True) for r in range(old)
    ]
    between = not _at_sync(states[0])
    merged = dict(states[0])
    if between and not _outer(states[0]):
        merged["model"] = _average_model([s["model"] for s in states])
    merged["optimizer"] = _average_optimizer([s["optimizer"] for s in states])
    rounds = merged.get("averager", {}).get("rounds", {})
    if isinstance(rounds, dict) and rounds.get("residuals") is not None:
        # a shared checkpoint holds the writer's residual only: each worker's is beside it
        own = (
            {r: o["residuals"] for r, o in load_own(folder, device).items()}
            if _marker(folder).get("shared")
            else {r: s["averager"]["rounds"]["residuals"] for r, s in enumerate(states)}
        )
        residuals = None  # none saved of their own (an older checkpoint): start without
        if own:
            residuals, _ = residuals_for(rank, world_size or old, written_by(folder), own)
        merged = _with_residuals(merged, residuals)
    if "sampler" in components:
        merged["sampler"] = _rescaled_position(
            states[0]["sampler"], components["sampler"].state_dict()
        )
    if "pacer" in merged:  # the workers start from one model: a new round of their own
        merged["pacer"] = new_round(states[min(rank, old - 1)]["pacer"])
    for key, component in components.items():  # each moves its own state (`resharded_state`)
        if key in merged and hasattr(component, "resharded_state"):
            merged[key] = component.resharded_state(merged[key])
    carry_rng(merged, states, rank)
    restore(merged, components, (*optional, "rng"), folder)
    if between and _outer(states[0]):
        averager = components["averager"]
        # parameters and float buffers are views of the flat buffers the anchors mirror
        for flat, anchor in zip(averager.flat.buffers, averager.rounds.anchors.first, strict=True):
            flat.copy_(anchor)
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
        return load_resharded(folder, info.rank, device, components, optional, info.world_size)
    return load(folder, info.rank, device, components, optional)

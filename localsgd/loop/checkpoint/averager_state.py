"""The averager as a checkpointed component: its state, what is each worker's own in a shared
checkpoint, and how its state moves to another world size or shard size.

`AveragerState` is what the trainer's registry holds under "averager" (`Synchroniser.
checkpoint_state`). Its state is the averager's own `state_dict()`. Moved to another layout:

- the counters, schedule and weights are the first old worker's (the same on every worker);
  weighted rounds start afresh (`Averager.resharded_state`: every worker starts from one model);
- the anchors and the outer momentum (the same on every worker) are cut to this rank's new
  shards (`relayout`);
- error-feedback residuals, what each worker failed to send: at the same world size each
  worker's own; otherwise every new worker takes the old residuals' sum divided by the old world
  size, so the next average adds exactly what the old workers' next one would have (sum/W of the
  old residuals): delayed, never lost, never counted twice. A shared checkpoint holds only the
  writer's, so each worker's own is saved beside it (`own_state`) and read back from there;
- between syncs with an outer step the model itself is set to the anchor once everything is
  loaded (`after_reshard`), dropping the local steps since (`localsgd.loop.checkpoint.reshard`).
"""

from __future__ import annotations

from typing import Any

import torch

from localsgd.averaging.trees import holds_tensor, scale_, tree_sum
from localsgd.loop.checkpoint.folders import load_own, read_marker
from localsgd.loop.checkpoint.relayout import flat_shapes, relayout
from localsgd.loop.checkpoint.state import Reshard


class AveragerState:
    """The averager's entry in the trainer's registry (the module docstring)."""

    def __init__(self, averager):
        self.averager = averager

    def state_dict(self) -> dict:
        return self.averager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.averager.load_state_dict(state)

    def own_state(self) -> dict | None:
        """What is this worker's own in a shared checkpoint: its error-feedback residuals (what
        it failed to send; the writer's would be every worker's otherwise), or None."""
        rounds = self.averager.rounds
        if not holds_tensor(rounds.residuals):
            return None  # no error feedback: nothing of its own (and no state_dict's copies)
        return {"residuals": [w.state_dict() for w in rounds.wires]}

    def resharded_state(self, states: list[dict], reshard: Reshard) -> dict:
        """This rank's averager state from the old workers' `states` (the module docstring)."""
        from localsgd.averaging import Averager

        if reshard.shared and reshard.sharded:  # one replica group's files: its rank's shard
            state = states[reshard.source]
            if _has_residuals(state):
                own = own_residuals(
                    reshard.folder, reshard.rank, reshard.world_size, reshard.shard_size,
                    reshard.device,
                )  # fmt: skip
                state = with_residuals(state, own)
        elif reshard.sharded:
            rank_states = [{"averager": s} for s in states]
            new_s = reshard.rank % reshard.shard_size
            state = averager_state(
                rank_states, reshard.old_shards, self.averager, reshard.shard_size, new_s
            )
        else:
            state = states[reshard.source]
            if _has_residuals(state):
                own = (
                    {r: o["residuals"] for r, o in load_own(reshard.folder, reshard.device).items()}
                    if reshard.shared
                    else {r: s["rounds"]["residuals"] for r, s in enumerate(states)}
                )
                residuals = None  # none saved of their own (an older checkpoint): start without
                if own:
                    residuals, _ = residuals_for(
                        reshard.rank, reshard.world_size, reshard.old_world, own
                    )
                state = with_residuals(state, residuals)
        return Averager.resharded_state(state)

    def after_reshard(self, reshard: Reshard) -> None:
        """Between syncs with an outer step every worker starts from the anchor."""
        if not reshard.at_sync and reshard.outer:
            from_anchor(self.averager)


def _has_residuals(state: dict) -> bool:
    rounds = state.get("rounds")
    return isinstance(rounds, dict) and rounds.get("residuals") is not None


def with_residuals(state: dict, residuals: Any) -> dict:
    """An averager state with its error-feedback residuals replaced."""
    return {**state, "rounds": {**state["rounds"], "residuals": residuals}}


def residuals_for(
    rank: int, world_size: int, written_by: int, own: dict[int, object]
) -> tuple[object, str]:
    """The error-feedback residuals rank `rank` of `world_size` workers resumes with, from the
    old workers' own residuals `own` (by rank, of `written_by` workers), and what was done.

    At the same world size each worker takes its own. Otherwise every new worker takes the sum
    of the old residuals divided by the old world size (the module docstring). A worker whose
    own file is missing (it died before writing it) loses its residual, and the line says so."""
    if world_size == written_by and rank in own:
        return own[rank], "each worker its own residual"
    present = sorted(own)
    total = scale_(tree_sum([own[r] for r in present]), 1.0 / written_by)
    lost = written_by - len(present)
    what = f"the {written_by} workers' residuals summed over {written_by}, on every worker"
    return total, what + (f" ({lost} worker(s)' residuals missing, lost)" if lost else "")


def own_residuals(folder: str, rank: int, world_size: int, shard_size: int, device):
    """The error-feedback residuals rank `rank` (of `world_size`, groups of `shard_size`)
    resumes with from a shared sharded checkpoint, read from the ranks' own files beside it: at
    the same number of groups its own; otherwise (or where its file is missing) the same
    shard's residuals of the old groups summed over their number, on every new group
    (`residuals_for`). None when no rank saved one."""
    old_world = int(read_marker(folder)["world_size"])
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


def averager_state(
    states: list[dict], old_shards: int, averager, new_shards: int, new_s: int
) -> dict:
    """Rank 0's averager state with its anchors, outer momentum and residuals relaid out for
    shard `new_s` of `new_shards` (from the old ranks' `states`, all of them, in groups of
    `old_shards`; `averager` the new one, whose flat buffers give the shapes)."""
    state = states[0]["averager"]
    rounds = state.get("rounds", {})
    if not isinstance(rounds, dict) or not rounds:
        return state
    groups = len(states) // old_shards
    group0 = [s["averager"]["rounds"] for s in states[:old_shards]]  # the same in every group
    out = {**rounds, **_outer_relaid(group0, averager, new_shards, new_s)}
    syncer = state.get("async", {}).get("syncer")
    if syncer is not None:
        # asynchronous rounds: each shard's syncer (on replica group 0's rank of that shard)
        # holds that shard's global model and outer momentum, laid out as the rounds' own
        syncers = [s["averager"]["async"]["syncer"] for s in states[:old_shards]]
        relaid = {**syncer, **_outer_relaid(syncers, averager, new_shards, new_s)}
        state = {**state, "async": {**state["async"], "syncer": relaid}}
    shapes = flat_shapes(averager.flat, params_only=False)
    if rounds.get("residuals") is not None:
        # every new group takes the old groups' sum over the old number of groups: the next
        # average adds what the old groups' next one would have (the module docstring)
        residuals = []
        for b, first in enumerate(rounds["residuals"][0]):
            if first is None:
                residuals.append(None)
                continue
            total = None
            for g in range(groups):
                old = [
                    s["averager"]["rounds"]["residuals"][0][b]
                    for s in states[g * old_shards : (g + 1) * old_shards]
                ]
                whole = relayout(old, shapes[b], new_shards, new_s)
                total = whole if total is None else total.add_(whole)
            residuals.append(total.div_(groups))
        out["residuals"] = [residuals]
    return {**state, "rounds": out}


def _outer_relaid(olds: list[dict], averager, new_shards: int, new_s: int) -> dict:
    """The `anchors` and outer `optimizers` of `olds` (one state per old shard, in shard order)
    laid out for shard `new_s` of `new_shards`: the whole model's outer SGD (resharding refuses
    fragments), one outer parameter per buffer that leads with parameters, their prefix of it."""
    first, out = olds[0], {}
    shapes = flat_shapes(averager.flat, params_only=False)
    if "anchors" in first:
        out["anchors"] = [
            relayout([r["anchors"][b] for r in olds], shapes[b], new_shards, new_s)
            for b in range(len(shapes))
        ]
    if first.get("optimizers"):
        param_shapes = [s for s in flat_shapes(averager.flat, params_only=True) if s]
        optim = first["optimizers"][0]
        new_state = {}
        for k, entry in optim["state"].items():
            entry = dict(entry)
            # laid out as the parameter: the momentum, Delayed Nesterov's pending sum
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    old = [r["optimizers"][0]["state"][k][name] for r in olds]
                    entry[name] = relayout(old, param_shapes[int(k)], new_shards, new_s)
            new_state[k] = entry
        out["optimizers"] = [{**optim, "state": new_state}]
    return out


def from_anchor(averager) -> None:
    """Every parameter set to the averager's anchor (the model of the last outer step)."""
    flat = averager.flat
    for buffer, anchor in zip(flat.buffers, averager.rounds.anchors.first, strict=True):
        buffer.copy_(anchor)  # unsharded: the parameters' storage; sharded: the mirror
    if flat.mirror:
        flat.push()

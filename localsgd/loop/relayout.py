"""The averager's flat state and the optimizer's state across sharded layouts (used by
`localsgd.loop.checkpoint_dcp` to resume with another shard size or number of groups).

The averager's anchors, outer momentum and error-feedback residuals are flat buffers laid out
like its `FlatBuffers`: per buffer, the concatenation of this rank's piece of each tensor in slot
order (a sharded parameter's local shard, an unsharded one whole). FSDP2 cuts dim 0 into
`torch.chunk` pieces, so the pieces of every shard are known from the global shapes alone: the
old shards' buffers are cut back into pieces, joined whole and cut again for the new layout.
"""

from __future__ import annotations

import torch


def _rows(dim0: int, shards: int, s: int) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 that shard `s` of `shards` holds: FSDP2 cuts dim 0 in
    `torch.chunk` pieces (ceil(dim0 / shards) rows each; the last ones short or empty)."""
    size = -(-dim0 // shards)
    return min(dim0, s * size), min(dim0, (s + 1) * size)


def _piece(shape: torch.Size, shards: int, s: int) -> torch.Size:
    if shards == 1 or len(shape) == 0:
        return shape
    start, stop = _rows(shape[0], shards, s)
    return torch.Size([stop - start, *shape[1:]])


def relayout(
    old: list[torch.Tensor], shapes: list[torch.Size], new_shards: int, new_s: int
) -> torch.Tensor:
    """One flat buffer laid out for shard `new_s` of `new_shards` (1: the whole tensors), from
    the old shards' flat buffers `old` (one per shard of the old layout, in shard order), each
    the concatenation of that shard's pieces of the tensors of `shapes`, in order."""
    offsets = [0] * len(old)
    out = []
    for shape in shapes:
        parts = []
        for s, flat in enumerate(old):
            piece = _piece(shape, len(old), s)
            parts.append(flat[offsets[s] : offsets[s] + piece.numel()].view(piece))
            offsets[s] += piece.numel()
        whole = torch.cat(parts) if len(shape) else parts[0]
        if new_shards > 1 and len(shape):
            start, stop = _rows(shape[0], new_shards, new_s)
            whole = whole[start:stop]
        out.append(whole.reshape(-1))
    return torch.cat(out) if out else old[0].new_empty(0)


def _group_shapes(averager, params_only: bool) -> list[list[torch.Size]]:
    """Per flat buffer, the global shapes of the tensors in it (in slot order)."""
    flat = averager.flat
    shapes: list[list[torch.Size]] = [[] for _ in flat.buffers]
    for t, (g, _, _) in zip(flat.tensors, flat.slots, strict=True):
        if not params_only or isinstance(t, torch.nn.Parameter):
            shapes[g].append(t.shape)  # a DTensor's shape is the global one
    return shapes


def averager_state(
    states: list[dict], old_shards: int, averager, new_shards: int, new_s: int
) -> dict:
    """Rank 0's averager state with its anchors, outer momentum and residuals relaid out for
    shard `new_s` of `new_shards` (from the old ranks' `states`, all of them)."""
    state = states[0]["averager"]
    rounds = state.get("rounds", {})
    if not isinstance(rounds, dict) or not rounds:
        return state
    groups = len(states) // old_shards
    group0 = [s["averager"]["rounds"] for s in states[:old_shards]]  # the same in every group
    shapes = _group_shapes(averager, params_only=False)
    out = dict(rounds)
    if "anchors" in rounds:
        out["anchors"] = [
            relayout([r["anchors"][b] for r in group0], shapes[b], new_shards, new_s)
            for b in range(len(shapes))
        ]
    if rounds.get("optimizers"):
        # the whole model's outer SGD (resharding refuses fragments): one outer parameter per
        # buffer that leads with parameters, their prefix of it
        param_shapes = [s for s in _group_shapes(averager, params_only=True) if s]
        optim = rounds["optimizers"][0]
        new_state = {}
        for k, entry in optim["state"].items():
            entry = dict(entry)
            if isinstance(entry.get("momentum_buffer"), torch.Tensor):
                old = [r["optimizers"][0]["state"][k]["momentum_buffer"] for r in group0]
                entry["momentum_buffer"] = relayout(old, param_shapes[int(k)], new_shards, new_s)
            new_state[k] = entry
        out["optimizers"] = [{**optim, "state": new_state}]
    if rounds.get("residuals") is not None:
        # every new group takes the old groups' sum over the old number of groups: the next
        # average adds what the old groups' next one would have (localsgd.loop.reshard)
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


def by_name(optim_state: dict, model: torch.nn.Module, optimizer) -> dict:
    """A torch optimizer state dict (parameters by index) keyed by parameter name instead, as
    `set_state_dict` takes it: index i is the i-th parameter of `optimizer`'s groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]]
    return {
        "state": {order[i]: entry for i, entry in optim_state["state"].items()},
        "param_groups": groups,
    }


def from_anchor(averager) -> None:
    """Every parameter set to the averager's anchor (the model of the last outer step)."""
    flat = averager.flat
    for buffer, anchor in zip(flat.buffers, averager.rounds.anchors.first, strict=True):
        buffer.copy_(anchor)  # unsharded: the parameters' storage; sharded: the mirror
    if flat.mirror:
        flat.push()


def fsdp_units(model: torch.nn.Module, blocks_path: str | None = None) -> list[str]:
    """The FSDP2 units a sharded run wraps `model` in (`Sharding.shard`: one per block, then the
    root; `blocks_path`: dist.shard_blocks), each as "name: param[shape], ...", global shapes;
    the same for the whole module and its sharded copy. A checkpoint of other units cannot be
    read into this model."""
    from localsgd.averaging.fragments import model_blocks

    names = {id(m): n for n, m in model.named_modules()}
    blocks = model_blocks(model, blocks_path)
    inside = {id(p) for b in blocks for p in b.parameters()}
    units = [(names[id(b)], list(b.named_parameters(prefix=names[id(b)]))) for b in blocks]
    units.append(("(root)", [(n, p) for n, p in model.named_parameters() if id(p) not in inside]))
    return [
        f"{name}: " + ", ".join(f"{n}{list(p.shape)}" for n, p in params) for name, params in units
    ]

"""Flat state and optimizer state across sharded layouts (resuming with another shard size or
number of groups).

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


def flat_shapes(flat, params_only: bool) -> list[list[torch.Size]]:
    """Per buffer of `flat` (a `FlatBuffers`), the global shapes of the tensors in it (in slot
    order): a DTensor's shape is the global one."""
    shapes: list[list[torch.Size]] = [[] for _ in flat.buffers]
    for t, (g, _, _) in zip(flat.tensors, flat.slots, strict=True):
        if not params_only or isinstance(t, torch.nn.Parameter):
            shapes[g].append(t.shape)
    return shapes


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


def fsdp_units(model: torch.nn.Module, blocks_path: str | None = None) -> list[str]:
    """The FSDP2 units a sharded run wraps `model` in (`Sharding.shard`: one per block, then the
    root; `blocks_path`: dist.shard_blocks), each as "name: param[shape], ...", global shapes;
    the same for the whole module and its sharded copy. A checkpoint of other units cannot be
    read into this model."""
    from localsgd.averaging.streaming.fragments import model_blocks

    names = {id(m): n for n, m in model.named_modules()}
    blocks = model_blocks(model, blocks_path)
    inside = {id(p) for b in blocks for p in b.parameters()}
    units = [(names[id(b)], list(b.named_parameters(prefix=names[id(b)]))) for b in blocks]
    units.append(("(root)", [(n, p) for n, p in model.named_parameters() if id(p) not in inside]))
    return [
        f"{name}: " + ", ".join(f"{n}{list(p.shape)}" for n, p in params) for name, params in units
    ]

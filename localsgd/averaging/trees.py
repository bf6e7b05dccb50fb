"""Trees of tensors: the nested dicts, lists and tuples that state dicts are, walked in one place.

Checkpoints, resharding, healing and torchft's rounds all copy, sum, scale or re-shard whole
state dicts; every such walk is here (`tests/test_layout.py` keeps it so). A tree's leaves are
tensors and anything else (numbers, strings, None), which the walks leave as they are. Sums and
means go in the order the trees are given, so the result is the same on every worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from localsgd.averaging.flat import is_dtensor, local_tensor


def _is_tree(tree: Any) -> bool:
    return isinstance(tree, (dict, list, tuple))


def _children(tree: Any):
    if isinstance(tree, dict):
        return tree.items()
    if isinstance(tree, (list, tuple)):
        return enumerate(tree)
    return ()


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """A new tree of the same shape, with `fn(t)` in place of every tensor `t`."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(fn, v) for v in tree)
    return tree


def clone_tree(tree: Any) -> Any:
    """A copy whose tensors are detached clones: nothing in it shares storage with `tree`."""
    return map_tensors(lambda t: t.detach().clone(), tree)


def local_tree(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard (what this rank holds of it)."""
    return map_tensors(local_tensor, tree)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor of `tree`, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for _, child in _children(tree) for t in tensors_in(child)]


def holds_tensor(tree: Any) -> bool:
    """Whether `tree` holds at least one tensor."""
    return bool(tensors_in(tree))


def as_dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """`local` (a shard) made a DTensor on the mesh and placements of the DTensor `like`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def into_dtensors(theirs: Any, own: Any) -> Any:
    """`theirs` with each tensor where `own` holds a DTensor made a DTensor like it (a tree of
    local shards put back onto this rank's layout)."""
    if is_dtensor(own):
        return as_dtensor_like(theirs, own)
    if isinstance(theirs, dict) and isinstance(own, dict):
        return {k: into_dtensors(v, own.get(k)) for k, v in theirs.items()}
    pairs = isinstance(theirs, (list, tuple)) and isinstance(own, (list, tuple))
    if pairs and len(theirs) == len(own):
        return type(theirs)(into_dtensors(t, o) for t, o in zip(theirs, own, strict=True))
    return theirs


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def is_float_array(t: torch.Tensor) -> bool:
    """A floating-point tensor of at least one dimension: an optimizer's moments, not its step
    count (a 0-d tensor, the same on every worker)."""
    return t.is_floating_point() and t.dim() > 0


def _every(t: torch.Tensor) -> bool:
    return True


def add_(total: Any, other: Any, where: Callable[[torch.Tensor], bool] = _every) -> Any:
    """`total` += `other` in place, leaf by leaf, on the tensors `where` picks (a DTensor through
    its local shard); the other leaves stay `total`'s. Returns `total`."""
    if isinstance(total, torch.Tensor):
        if where(total):
            local_tensor(total).add_(local_tensor(other))
        return total
    for key, child in _children(total):
        picked = where(child) if isinstance(child, torch.Tensor) else _is_tree(child)
        if picked:  # `other` is read only where something is added
            add_(child, other[key], where)
    return total


def _each_(tree: Any, op: Callable[[torch.Tensor], Any], where: Callable[[torch.Tensor], bool]):
    """`op` on this rank's part of every tensor `where` picks, in place. Returns `tree`."""
    if isinstance(tree, torch.Tensor):
        if where(tree):
            op(local_tensor(tree))
        return tree
    for _, child in _children(tree):
        _each_(child, op, where)
    return tree


def scale_(tree: Any, factor: float, where: Callable[[torch.Tensor], bool] = _every) -> Any:
    """Every tensor `where` picks multiplied by `factor` in place. Returns `tree`."""
    return _each_(tree, lambda t: t.mul_(factor), where)


def divide_(tree: Any, divisor: float, where: Callable[[torch.Tensor], bool] = _every) -> Any:
    """Every tensor `where` picks divided by `divisor` in place (`div_`: a division is not a
    multiplication by the reciprocal, bit for bit). Returns `tree`."""
    return _each_(tree, lambda t: t.div_(divisor), where)


def tree_sum(trees: list, where: Callable[[torch.Tensor], bool] = _every) -> Any:
    """The leaf-by-leaf sum of `trees` (of one shape), added in order into a clone of the first;
    leaves `where` does not pick, and those that are not tensors, are the first tree's."""
    total = clone_tree(trees[0])
    for other in trees[1:]:
        add_(total, other, where)
    return total


def tree_mean(trees: list, where: Callable[[torch.Tensor], bool] = _every) -> Any:
    """The leaf-by-leaf mean of `trees`: summed in order, then divided once by their number
    (the leaves `where` picks; the others are the first tree's)."""
    return divide_(tree_sum(trees, where), len(trees), where)


def distinct_nbytes(tensors) -> int:
    """Bytes of the distinct tensors in `tensors` on this rank (a DTensor: its local shard; the
    same memory reached twice, e.g. a view and its tensor's alias, counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        local = local_tensor(t)
        key = (local.data_ptr(), local.numel())
        if local.numel() and key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def tree_as_json(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """`tree` as json (nothing that unpickles: each tensor's shape and dtype, each dict's keys
    with their types, an optimizer's ints too) and the tensors it holds (on the host), in
    order: a state dict sent as a message, its tensors point-to-point after it."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node.detach().cpu().contiguous())
            return {"t": list(node.shape), "dtype": str(node.dtype).removeprefix("torch.")}
        if isinstance(node, dict):
            return {"d": [[_json_key(k), walk(v)] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return {"l" if isinstance(node, list) else "u": [walk(v) for v in node]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"v": node}
        raise TypeError(f"a tree holding a {type(node).__name__} is not sent as json")

    return walk(tree), tensors


def _json_key(key: Any) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    raise TypeError(f"a dict key of type {type(key).__name__} is not sent as json")


def tree_from_json(packed: Any, recv: Callable[[torch.Tensor], None]) -> Any:
    """The tree `tree_as_json` described, each tensor filled by `recv(tensor)` in order."""
    if "t" in packed:
        tensor = torch.empty(packed["t"], dtype=getattr(torch, packed["dtype"]))
        recv(tensor)
        return tensor
    if "d" in packed:
        return {k: tree_from_json(v, recv) for k, v in packed["d"]}
    if "l" in packed:
        return [tree_from_json(v, recv) for v in packed["l"]]
    if "u" in packed:
        return tuple(tree_from_json(v, recv) for v in packed["u"])
    return packed["v"]

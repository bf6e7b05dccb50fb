"""Split the train set disjointly across workers.

Every rank computes the whole partition from the same seed and keeps its own part, so the shards
agree without any communication. Empty shards are checked for all ranks, not just the caller's, so
every rank raises the same error instead of one failing while the others wait in a collective.
"""

from __future__ import annotations

import numpy as np
import torch

from localsgd.data._seeding import derive_seed

_PARTITION_STREAM = 2

# data.partition: how `shard_indices` splits the train set (described in its docstring)
PARTITIONS = ("iid", "by_class", "dirichlet", "contiguous")


def shard_indices(
    labels: torch.Tensor,
    world_size: int,
    rank: int,
    partition: str,
    seed: int,
    classes_per_worker: int = 2,
    alpha: float = 0.5,
) -> torch.Tensor:
    """Sorted int64 train-set indices of worker `rank` out of `world_size`.

    iid: a seeded permutation cut into near-equal parts. by_class: after a seeded shuffle of the
    classes, workers take `classes_per_worker` consecutive classes round-robin and split each
    class's samples evenly with the other holders (when world_size * classes_per_worker is below
    the number of classes, the unassigned classes' samples go unused). dirichlet: each class's
    samples are split by proportions drawn from Dirichlet(alpha) over the workers. contiguous:
    worker r takes the r-th of `world_size` near-equal consecutive runs of the train set, in its
    order: for a text corpus, a stretch of the text (with Shakespeare, different plays), the
    non-iid split of language-model data.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if partition not in PARTITIONS:
        allowed = ", ".join(PARTITIONS)
        raise ValueError(f"data.partition must be one of {allowed}, got {partition!r}")
    if labels.dim() != 1 and partition not in ("iid", "contiguous"):
        raise ValueError(
            f"data.partition must be iid or contiguous for language-model data (its targets "
            f"are sequences, not classes), got {partition!r}"
        )
    n = labels.shape[0]
    stream = derive_seed(seed, _PARTITION_STREAM)
    if partition == "iid":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(stream))
        shards = [s.numpy() for s in torch.tensor_split(perm, world_size)]
    elif partition == "contiguous":
        shards = np.array_split(np.arange(n), world_size)
    else:
        y = labels.cpu().numpy()
        rng = np.random.default_rng(stream)
        if partition == "by_class":
            shards = _by_class(y, world_size, classes_per_worker, rng)
        else:
            shards = _dirichlet(y, world_size, alpha, rng)
    empty = [r for r, s in enumerate(shards) if len(s) == 0]
    if empty:
        raise ValueError(
            f"data.partition={partition} leaves worker(s) {empty} with no training samples "
            f"({n} samples over {world_size} workers); use fewer workers, more data, "
            f"{'a larger data.alpha' if partition == 'dirichlet' else 'data.partition=iid'}"
        )
    return torch.from_numpy(np.sort(np.asarray(shards[rank], dtype=np.int64)))


def _class_members(y: np.ndarray, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Each class's sample indices in a seeded random order, so splits are not in file order."""
    return {int(c): rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)}


def _by_class(
    y: np.ndarray, world_size: int, classes_per_worker: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if classes_per_worker < 1:
        raise ValueError(
            f"data.classes_per_worker must be an integer >= 1, got {classes_per_worker}"
        )
    members = _class_members(y, rng)
    order = rng.permutation(np.array(sorted(members)))
    per_worker = min(classes_per_worker, len(order))  # more than all classes means all classes
    holders: dict[int, list[int]] = {int(c): [] for c in order}
    for w in range(world_size):
        for s in range(per_worker):
            # Consecutive slots in the cycle are distinct classes because per_worker <= #classes.
            holders[int(order[(w * per_worker + s) % len(order)])].append(w)
    shards: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for c, workers in holders.items():
        if not workers:
            continue
        for w, part in zip(workers, np.array_split(members[c], len(workers)), strict=True):
            shards[w].append(part)
    return [np.concatenate(parts) if parts else np.empty(0, np.int64) for parts in shards]


def _dirichlet(
    y: np.ndarray, world_size: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    if alpha <= 0:
        raise ValueError(f"data.alpha must be > 0, got {alpha}")
    shards: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for idx in _class_members(y, rng).values():
        props = rng.dirichlet(np.full(world_size, float(alpha)))
        cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
        for w, part in enumerate(np.split(idx, cuts)):
            shards[w].append(part)
    return [np.concatenate(parts) for parts in shards]

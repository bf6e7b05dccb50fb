"""The validation split: carved from the training data, the same on every rank.

Periodic evaluation, a sweep's `optimized_metric`, `sync.score`'s held-out batches and
`trainer.keep_best` read it; the test set is read once, by the final evaluation. `data.val_fraction`
of the train set is held out (0: none, and periodic evaluation reads the test set as before):

- classification: a seeded draw of samples (its own seed stream: the same on every rank and
  unrelated to the partition's), the rest kept in their order;
- language models (`task == "lm"`): the last span of the train windows, which lie in file order,
  so no validation window is a neighbour of a training one but at the span's edge (the test
  span follows it);
- a set with random transforms (cifar10, image_folder) is evaluated without them: its callable
  gives `train_eval`, the same samples with the test transform, and the validation samples come
  from there.

A dataset callable that returns its own `val` keeps it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from localsgd.config import ConfigError
from localsgd.data._seeding import derive_seed

_VALIDATION_STREAM = 6


def validation_of(data: Any) -> Dataset | None:
    """The data's validation split, or None."""
    return getattr(data, "val", None)


def with_validation(data: Any, fraction: float, seed: int) -> Any:
    """`data` with `val` carved from its train set (a copy; `data` is left as it is)."""
    if validation_of(data) is not None:
        return data
    fraction = float(fraction)
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return data
    n = len(data.train)
    held = int(round(n * fraction))
    if not 1 <= held < n:
        raise ConfigError(
            f"data.val_fraction={fraction} must leave a validation and a train sample of the "
            f"{n} train samples (it holds out {held}); use a larger fraction, more data, or 0"
        )
    if getattr(data, "task", "classification") == "lm":
        kept, val = torch.arange(n - held), torch.arange(n - held, n)
    else:
        gen = torch.Generator().manual_seed(derive_seed(seed, _VALIDATION_STREAM))
        order = torch.randperm(n, generator=gen)
        val, kept = order[:held].sort().values, order[held:].sort().values
    out = copy.copy(data)
    out.train = _subset(data.train, kept)
    plain = getattr(data, "train_eval", None)
    out.val = _subset(data.train if plain is None else plain, val)
    return out


def _subset(dataset: Dataset, indices: torch.Tensor) -> Dataset:
    """The samples at `indices`: a tensor set stays a tensor set (trained from memory)."""
    if isinstance(dataset, TensorDataset):
        part = copy.copy(dataset)
        part.tensors = tuple(t[indices] for t in dataset.tensors)
        return part
    return Subset(dataset, indices.tolist())

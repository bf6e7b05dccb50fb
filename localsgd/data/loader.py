"""A rank's batches: built from the `data` config node, in memory or through a DataLoader.

`load_data` instantiates the dataset callable (and carves the validation split:
`localsgd.data.validation`); `make_batches` gives the trainer one object with
`next() -> (x, y)` on the device and `state_dict()` / `load_state_dict()` (the ShardSampler's, so a
run killed mid-epoch resumes at the same sample). Two paths, chosen by `data.loader`:

- memory (auto for a TensorDataset train set: its samples are already tensors, with no per-sample
  transform): the whole train set sits on the device and a batch is one index into it.
- stream (auto for anything else: files, per-sample transforms): a torch DataLoader over the
  rank's shard, `data.num_workers` worker processes, pinned memory on CUDA. Its batch sampler is a
  copy of the rank's ShardSampler running ahead (the DataLoader prefetches); the trainer's own
  sampler advances one batch per batch consumed, so its state is where training stands.

Random transforms draw from torch's RNG, reseeded for every batch from (seed, rank, epoch,
position): a batch's augmentation depends on neither the number of loader workers nor on where
a run was resumed, so a resumed run is bit-identical to one that never stopped.
"""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from localsgd.config import DATA_OPTIONS, ConfigError
from localsgd.data._seeding import derive_seed
from localsgd.data.sampler import ShardSampler
from localsgd.data.validation import with_validation
from localsgd.instantiate import build

_AUGMENT_STREAM = 4

# data.loader: the two paths above, or auto to pick one by the train set's type (`in_memory`)
LOADERS = ("auto", "memory", "stream")


def load_data(cfg: Mapping, seed: int) -> Any:
    """Instantiate `cfg._target_` (offered `seed`) and check the result's contract. The node's
    own keys (`localsgd.config.DataOptions`) are localsgd's, not the callable's arguments."""
    data = build(cfg, "data", drop=DATA_OPTIONS, seed=int(seed))
    missing = [a for a in ("train", "test", "num_classes") if not hasattr(data, a)]
    if missing:
        raise ConfigError(
            f"data._target_ must return an object with train, test and num_classes, got a "
            f"{type(data).__name__} without {', '.join(missing)} from {cfg['_target_']!r}"
        )
    n = data.num_classes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"data._target_ must give num_classes as an integer >= 1, got {n!r}")
    for split in ("train", "test"):
        size = len(getattr(data, split))
        if size < 1:
            raise ConfigError(f"data._target_ must give a non-empty {split} set, got {size}")
    return with_validation(data, cfg.get("val_fraction", 0.0), seed)


def task_of(data: Any) -> str:
    return getattr(data, "task", "classification")


def labels_of(dataset: Dataset) -> torch.Tensor:
    """Labels for the partition: `.targets` where the set has them, else one pass over it."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[1]
    if isinstance(dataset, Subset):  # e.g. what the validation split left of a file-backed set
        return labels_of(dataset.dataset)[torch.as_tensor(dataset.indices, dtype=torch.long)]
    targets = getattr(dataset, "targets", None)
    if targets is None:
        targets = [dataset[i][1] for i in range(len(dataset))]
    return torch.as_tensor(targets)


def input_shape_of(data: Any) -> tuple[int, ...]:
    """One sample's shape: as the data declares it, else read from the first train sample."""
    shape = getattr(data, "input_shape", None)
    if shape is None:
        shape = tuple(torch.as_tensor(data.train[0][0]).shape)
    return tuple(int(s) for s in shape)


def in_memory(train: Dataset, loader: str) -> bool:
    """data.loader=auto: memory exactly when the train set is a TensorDataset of (x, y)."""
    if loader not in LOADERS:
        raise ConfigError(f"data.loader must be one of {', '.join(LOADERS)}, got {loader!r}")
    if loader == "auto":
        return isinstance(train, TensorDataset) and len(train.tensors) == 2
    if loader == "memory" and not isinstance(train, TensorDataset):
        raise ConfigError(
            f"data.loader must be auto or stream for a train set of type "
            f"{type(train).__name__} (memory needs a TensorDataset), got 'memory'"
        )
    return loader == "memory"


def _worker_context() -> str | None:
    # Ranks started by torch.multiprocessing's spawn inherit "spawn" as the default start method,
    # and a spawned loader worker re-imports torch (~3 s) on every loader start. Fork is what a
    # DataLoader uses under torchrun on Linux (ranks with live process groups fork their workers),
    # so it is chosen wherever the platform has it.
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def _private_generator() -> torch.Generator:
    # A DataLoader draws its workers' base seed from this generator, by default torch's global
    # one: that draw would shift the model's dropout stream by whether and when a loader started.
    # The batches' randomness comes from _SeededBatch, so the base seed may be a constant.
    return torch.Generator().manual_seed(0)


class MemoryBatches:
    """The in-memory fast path: a batch is one index into the device-resident train tensors."""

    def __init__(self, train: TensorDataset, sampler: ShardSampler, device: torch.device):
        self.x, self.y = (t.to(device) for t in train.tensors)
        self.sampler = sampler
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.sampler.next_batch().to(self.device)
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def resharded_state(self, states: list[dict], reshard) -> dict:
        return self.sampler.resharded_state(states, reshard)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def reassign(self, extra: torch.Tensor, sources: list[int], batch_size: int | None = None):
        self.sampler.reassign(extra, sources, batch_size)

    def close(self) -> None:
        pass


class _SeededBatch(Dataset):
    """Fetches a batch of (index, seed) items with torch's RNG seeded from the batch's seed, so
    random transforms repeat exactly; the caller's RNG state is left as it was."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(items[0][1])
            return [self.dataset[i] for i, _ in items]


class _AheadSampler:
    """The DataLoader's batch sampler: a copy of the rank's sampler, run ahead of training."""

    def __init__(self, sampler: ShardSampler):
        self.sampler = copy.deepcopy(sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s = self.sampler
        while True:
            indices = s.next_batch()
            seed = derive_seed(s.seed, _AUGMENT_STREAM, s.rank, s.epoch, s.position)
            yield [(int(i), seed) for i in indices]


class StreamBatches:
    """A DataLoader over the rank's shard; one iterator for the whole run (no per-epoch restart
    of the loader workers), recreated only after `load_state_dict`."""

    def __init__(
        self, train: Dataset, sampler: ShardSampler, device: torch.device, num_workers: int = 0
    ):
        self.train = _SeededBatch(train)
        self.sampler = sampler
        self.device = device
        self.num_workers = int(num_workers)
        self._iter: Iterator | None = None

    def _loader(self) -> DataLoader:
        return DataLoader(
            self.train,
            batch_sampler=_AheadSampler(self.sampler),
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
            generator=_private_generator(),
            multiprocessing_context=_worker_context() if self.num_workers else None,
        )

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._iter is None:
            self._iter = iter(self._loader())
        x, y = next(self._iter)
        self.sampler.next_batch()  # bookkeeping: the batch just consumed
        cuda = self.device.type == "cuda"  # pinned host memory: the copy may overlap compute
        return x.to(self.device, non_blocking=cuda), y.to(self.device, non_blocking=cuda)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def resharded_state(self, states: list[dict], reshard) -> dict:
        return self.sampler.resharded_state(states, reshard)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self.close()  # the next batch comes from a loader started at the restored position

    def reassign(self, extra: torch.Tensor, sources: list[int], batch_size: int | None = None):
        self.sampler.reassign(extra, sources, batch_size)
        self.close()  # the loader ran ahead on the old shard

    def close(self) -> None:
        self._iter = None  # the iterator's finaliser stops its worker processes


def make_batches(
    data: Any, cfg: Mapping, sampler: ShardSampler, device: torch.device
) -> MemoryBatches | StreamBatches:
    if in_memory(data.train, cfg.get("loader", "auto")):
        return MemoryBatches(data.train, sampler, device)
    return StreamBatches(data.train, sampler, device, cfg.get("num_workers", 0))


def eval_batches(
    test: Dataset,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
    limit: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The test set in order, in batches on `device`; TensorDatasets are sliced directly.
    `limit`: only that many samples, evenly spaced over the set (the same ones every time)."""
    if limit is not None and limit < len(test):
        keep = torch.linspace(0, len(test) - 1, limit).round().long().unique()
        if isinstance(test, TensorDataset):
            test = TensorDataset(*(t[keep] for t in test.tensors))
        else:
            test = Subset(test, keep.tolist())
    if isinstance(test, TensorDataset) and len(test.tensors) == 2:
        x, y = test.tensors
        for start in range(0, len(x), batch_size):
            yield x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        return
    loader = DataLoader(
        test,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        collate_fn=default_collate,
        generator=_private_generator(),
        multiprocessing_context=_worker_context() if num_workers else None,
    )
    for x, y in loader:
        yield x.to(device), y.to(device)

"""Load one dataset as CPU tensors, identical on every rank for the same seed.

Every loader is a pure function of (config, seed): ranks never exchange data, so each one must
rebuild exactly the same train and test sets on its own.
"""

from __future__ import annotations

import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localsgd.config import DATASETS
from localsgd.data._seeding import derive_seed

_DATASET_STREAM = 1
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
_CIFAR_DIR = "cifar-10-batches-py"


@dataclass
class Dataset:
    train_x: torch.Tensor  # float32 (N, *input_shape), or int64 (N, seq_len) for text
    train_y: torch.Tensor  # int64 (N,), or (N, seq_len) next-character targets for text
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int  # classes, or vocabulary size for text
    input_shape: tuple[int, ...]  # one sample's shape
    task: str = "classification"  # or "lm"
    vocab: str = ""  # text only: character of each token id, to decode generated samples


def _opt(cfg: Any, key: str) -> Any:
    return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)


def _standardise(train: torch.Tensor, test: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Scale both splits in place by the train statistics only, so no test information leaks."""
    mean = train.mean(dim=dims, keepdim=True)
    std = train.std(dim=dims, keepdim=True).clamp_min(1e-8)
    train.sub_(mean).div_(std)
    test.sub_(mean).div_(std)


def _mnist1d(cfg: Any, seed: int) -> Dataset:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args(as_dict=False)
    args.num_samples = int(_opt(cfg, "num_samples"))
    args.seed = seed % 2**32  # numpy's legacy seeding takes only 32 bits
    # make_dataset reseeds the global `random` and `np.random`; restore them so loading data does
    # not silently change what the rest of the run draws from those generators.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        raw = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    train_x = torch.as_tensor(raw["x"], dtype=torch.float32)
    test_x = torch.as_tensor(raw["x_test"], dtype=torch.float32)
    # One scalar mean/std keeps each signal's shape; per-position scaling would distort it.
    _standardise(train_x, test_x, dims=(0, 1))
    return Dataset(
        train_x,
        torch.as_tensor(raw["y"], dtype=torch.int64),
        test_x,
        torch.as_tensor(raw["y_test"], dtype=torch.int64),
        10,
        (40,),
    )


def _digits(cfg: Any, seed: int) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()  # ships with scikit-learn: no download
    x = (bunch.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x,
        y,
        test_size=float(_opt(cfg, "test_fraction")),
        stratify=y,
        random_state=derive_seed(seed, _DATASET_STREAM) % 2**32,
    )
    return Dataset(
        torch.from_numpy(x_tr),
        torch.from_numpy(y_tr),
        torch.from_numpy(x_te),
        torch.from_numpy(y_te),
        10,
        (1, 8, 8),
    )


def _synthetic(cfg: Any, seed: int) -> Dataset:
    n, c = int(_opt(cfg, "num_samples")), int(_opt(cfg, "num_classes"))
    f, noise = int(_opt(cfg, "num_features")), float(_opt(cfg, "noise"))
    if c < 2:
        raise ValueError(f"data.num_classes must be an integer >= 2, got {c}")
    g = torch.Generator().manual_seed(derive_seed(seed, _DATASET_STREAM))
    # Scaling by 3/sqrt(F) keeps the expected distance between two class means (~4.2) independent
    # of num_features, so data.noise alone sets the difficulty (noise=1: learnable, not trivial).
    means = torch.randn(c, f, generator=g) * (3.0 / f**0.5)
    y = torch.arange(n) % c  # balanced classes
    y = y[torch.randperm(n, generator=g)]
    x = means[y] + noise * torch.randn(n, f, generator=g)
    n_test = _test_count(n, float(_opt(cfg, "test_fraction")), "data.num_samples")
    train_x, test_x = x[:-n_test].clone(), x[-n_test:].clone()
    _standardise(train_x, test_x, dims=(0,))
    return Dataset(train_x, y[:-n_test].clone(), test_x, y[-n_test:].clone(), c, (f,))


def _test_count(n: int, fraction: float, key: str) -> int:
    n_test = int(round(n * fraction))
    if not 1 <= n_test < n:
        raise ValueError(
            f"{key} ({n}) is too small to hold out data.test_fraction={fraction}: "
            f"the train or the test split would be empty"
        )
    return n_test


def _cifar_folder(root: str) -> Path:
    base = Path(os.path.expanduser(root))
    for folder in (base / _CIFAR_DIR, base) if root else ():
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        if all((folder / name).is_file() for name in names):
            return folder
    raise FileNotFoundError(
        f"data.root: no CIFAR-10 python batches at '{root}'; download cifar-10-python.tar.gz from "
        f"{_CIFAR_URL} and extract it there"
    )


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as fh:
        batch = pickle.load(fh, encoding="bytes")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    return np.asarray(data, dtype=np.uint8), np.asarray(labels, dtype=np.int64)


def _cifar10(cfg: Any, seed: int) -> Dataset:
    del seed  # the official split is fixed
    folder = _cifar_folder(str(_opt(cfg, "root")))
    parts = [_cifar_batch(folder / f"data_batch_{i}") for i in range(1, 6)]
    test_raw, test_y = _cifar_batch(folder / "test_batch")

    def to_images(raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(raw).view(-1, 3, 32, 32).float().div_(255.0)

    train_x = to_images(np.concatenate([p[0] for p in parts]))
    test_x = to_images(test_raw)
    _standardise(train_x, test_x, dims=(0, 2, 3))
    train_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    return Dataset(train_x, train_y, test_x, torch.from_numpy(test_y), 10, (3, 32, 32))


def _text(cfg: Any, seed: int) -> Dataset:
    del seed  # windows are taken in file order, so there is nothing to draw
    given = str(_opt(cfg, "path"))
    path = Path(os.path.expanduser(given))
    if not given or not path.is_file():
        raise FileNotFoundError(
            f"data.path: no text file at '{given}'; point data.path at a plain-text (UTF-8) file"
        )
    text = path.read_text(encoding="utf-8")
    seq_len = int(_opt(cfg, "seq_len"))
    if seq_len < 1:
        raise ValueError(f"data.seq_len must be an integer >= 1, got {seq_len}")
    vocab = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)
    n_windows = len(ids) // (seq_len + 1)
    if n_windows < 2:
        raise ValueError(
            f"data.path: '{path}' has {len(ids)} characters, too few for a train and "
            f"a test window of data.seq_len+1={seq_len + 1} characters"
        )
    windows = ids[: n_windows * (seq_len + 1)].view(n_windows, seq_len + 1)
    n_test = max(1, min(n_windows - 1, int(round(n_windows * float(_opt(cfg, "test_fraction"))))))
    train, test = windows[:-n_test], windows[-n_test:]
    return Dataset(
        train[:, :-1].clone(),
        train[:, 1:].clone(),
        test[:, :-1].clone(),
        test[:, 1:].clone(),
        len(vocab),
        (seq_len,),
        task="lm",
        vocab=vocab,
    )


_LOADERS = {
    "mnist1d": _mnist1d,
    "digits": _digits,
    "synthetic": _synthetic,
    "cifar10": _cifar10,
    "text": _text,
}


def load_dataset(cfg: Any, seed: int) -> Dataset:
    """Build the dataset `cfg` (a DataConfig, DictConfig, namespace or dict) names, for `seed`."""
    name = _opt(cfg, "name")
    loader = _LOADERS.get(name)
    if loader is None:
        raise ValueError(f"data.name must be one of {', '.join(DATASETS)}, got {name!r}")
    return loader(cfg, int(seed))

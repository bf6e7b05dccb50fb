"""The built-in datasets, each a callable that `conf/data/*.yaml` names with `_target_`.

A dataset callable returns an object with `train` and `test` (torch Datasets of (x, y) pairs) and
`num_classes`; these return a `DataSplits`. The validation split is carved from `train` by
`load_data` (`localsgd.data.validation`). The tensor sets (mnist1d, digits, synthetic, text) are
`TensorDataset`s, trained from memory; cifar10 and image_folder read files and augment per sample,
through a DataLoader. Every callable is a pure function of its arguments and `seed`: ranks never
exchange data, so each must rebuild exactly the same sets on its own.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from localsgd.config import ConfigError
from localsgd.data._seeding import derive_seed
from localsgd.data.vision import import_torchvision

_DATASET_STREAM = 1
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
_CIFAR_DIR = "cifar-10-batches-py"
# per-channel statistics of the CIFAR-10 train set, the usual normalisation
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class LabelledTensors(TensorDataset):
    """A TensorDataset of (inputs, targets) that exposes `targets`, as torchvision sets do."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        super().__init__(x, y)

    @property
    def targets(self) -> torch.Tensor:
        return self.tensors[1]


@dataclass
class DataSplits:
    train: Dataset
    test: Dataset
    num_classes: int  # classes, or vocabulary size for text
    input_shape: tuple[int, ...] | None = None  # one sample's shape; None: read from a sample
    task: str = "classification"  # or "lm": (B, T) token ids, (B, T) next-token targets
    vocab: str = ""  # text only: character of each token id, to decode generated samples
    # the validation split, carved from train by `load_data` (data.val_fraction) unless given
    val: Dataset | None = None
    # the train samples without random transforms, where the validation samples are read from
    train_eval: Dataset | None = None


def _standardise(train: torch.Tensor, test: torch.Tensor, dims: tuple[int, ...]) -> None:
    """Scale both splits in place by the train statistics only, so no test information leaks."""
    mean = train.mean(dim=dims, keepdim=True)
    std = train.std(dim=dims, keepdim=True).clamp_min(1e-8)
    train.sub_(mean).div_(std)
    test.sub_(mean).div_(std)


def _tensors(train_x, train_y, test_x, test_y, num_classes: int, **kw) -> DataSplits:
    return DataSplits(
        LabelledTensors(train_x, train_y),
        LabelledTensors(test_x, test_y),
        num_classes,
        tuple(train_x.shape[1:]),
        **kw,
    )


def mnist1d(num_samples: int = 10000, seed: int = 0) -> DataSplits:
    """MNIST-1D (Greydanus 2020), generated offline: 40-sample 1-D signals, 10 classes."""
    if num_samples < 10:
        raise ConfigError(f"data.num_samples must be an integer >= 10, got {num_samples}")
    seed = seed % 2**32  # numpy's legacy seeding takes only 32 bits
    cache = _mnist1d_cache_file(int(num_samples), seed)
    raw = _read_arrays(cache)
    if raw is None:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args(as_dict=False)
        args.num_samples, args.seed = int(num_samples), seed
        # make_dataset reseeds the global `random` and `np.random`; restore them so loading data
        # does not silently change what the rest of the run draws from those generators.
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            made = make_dataset(args)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        raw = {k: np.asarray(made[k]) for k in ("x", "y", "x_test", "y_test")}
        _write_arrays(cache, raw)
    train_x = torch.as_tensor(raw["x"], dtype=torch.float32)
    test_x = torch.as_tensor(raw["x_test"], dtype=torch.float32)
    # One scalar mean/std keeps each signal's shape; per-position scaling would distort it.
    _standardise(train_x, test_x, dims=(0, 1))
    train_y = torch.as_tensor(raw["y"], dtype=torch.int64)
    return _tensors(train_x, train_y, test_x, torch.as_tensor(raw["y_test"]), 10)


def _mnist1d_cache_file(num_samples: int, seed: int) -> Path:
    """Generating MNIST-1D costs ~9 s of CPU in every process that builds it (the launcher and
    each worker), so the arrays are kept under data_dir(). The package version names the
    generator's other arguments, which are its defaults."""
    from importlib.metadata import version

    from localsgd.data.prepare import data_dir

    name = f"mnist1d-{version('mnist1d')}-n{num_samples}-seed{seed}.npz"
    return data_dir() / "mnist1d" / name


def _read_arrays(file: Path) -> dict | None:
    try:
        with np.load(file) as arrays:
            return {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None  # absent, or unreadable: generate again


def _write_arrays(file: Path, arrays: dict) -> None:
    """Atomically (workers may write the same file at once); an unwritable cache only costs time."""
    with contextlib.suppress(OSError):
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=file.parent, suffix=".npz", delete=False) as tmp:
            np.savez(tmp, **arrays)
        os.replace(tmp.name, file)


def digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    _fraction(test_fraction)
    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x,
        y,
        test_size=float(test_fraction),
        stratify=y,
        random_state=derive_seed(seed, _DATASET_STREAM) % 2**32,
    )
    return _tensors(*map(torch.from_numpy, (x_tr, y_tr, x_te, y_te)), 10)


def synthetic(
    num_samples: int = 4000,
    num_features: int = 32,
    num_classes: int = 10,
    noise: float = 1.0,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> DataSplits:
    """Gaussian class clusters: a quick, fully controlled classification task."""
    n, c, f = int(num_samples), int(num_classes), int(num_features)
    for key, value, low in (("num_classes", c, 2), ("num_features", f, 1)):
        if value < low:
            raise ConfigError(f"data.{key} must be an integer >= {low}, got {value}")
    if noise < 0:
        raise ConfigError(f"data.noise must be >= 0, got {noise}")
    n_test = _test_count(n, _fraction(test_fraction))
    g = torch.Generator().manual_seed(derive_seed(seed, _DATASET_STREAM))
    # Scaling by 3/sqrt(F) keeps the expected distance between two class means (~4.2) independent
    # of num_features, so data.noise alone sets the difficulty (noise=1: learnable, not trivial).
    means = torch.randn(c, f, generator=g) * (3.0 / f**0.5)
    y = torch.arange(n) % c  # balanced classes
    y = y[torch.randperm(n, generator=g)]
    x = means[y] + float(noise) * torch.randn(n, f, generator=g)
    train_x, test_x = x[:-n_test].clone(), x[-n_test:].clone()
    _standardise(train_x, test_x, dims=(0,))
    return _tensors(train_x, y[:-n_test].clone(), test_x, y[-n_test:].clone(), c)


def _fraction(value: float) -> float:
    if not 0 < value < 1:
        raise ConfigError(f"data.test_fraction must be in (0, 1), got {value}")
    return float(value)


def _test_count(n: int, fraction: float) -> int:
    n_test = int(round(n * fraction))
    if not 1 <= n_test < n:
        raise ConfigError(
            f"data.num_samples must leave a train and a test split at "
            f"data.test_fraction={fraction}, got {n}"
        )
    return n_test


def text(path: str, seq_len: int = 64, test_fraction: float = 0.1) -> DataSplits:
    """Characters of a plain-text (UTF-8) file in windows of seq_len+1, in file order; the last
    test_fraction of the windows is the test set. Targets are the inputs shifted by one."""
    file = Path(os.path.expanduser(str(path)))
    if not path or not file.is_file():
        raise ConfigError(f"data.path must name an existing text file, got {path!r}")
    if seq_len < 1:
        raise ConfigError(f"data.seq_len must be an integer >= 1, got {seq_len}")
    content = file.read_text(encoding="utf-8")
    vocab = "".join(sorted(set(content)))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([lookup[ch] for ch in content], dtype=torch.int64)
    n_windows = len(ids) // (seq_len + 1)
    if n_windows < 2:
        raise ConfigError(
            f"data.path must hold at least two windows of data.seq_len+1={seq_len + 1} "
            f"characters, got {len(ids)} characters in {path}"
        )
    windows = ids[: n_windows * (seq_len + 1)].view(n_windows, seq_len + 1)
    n_test = max(1, min(n_windows - 1, int(round(n_windows * float(test_fraction)))))
    train, test = windows[:-n_test], windows[-n_test:]
    return _tensors(
        train[:, :-1].clone(),
        train[:, 1:].clone(),
        test[:, :-1].clone(),
        test[:, 1:].clone(),
        len(vocab),
        task="lm",
        vocab=vocab,
    )


def shakespeare(path: str = "", seq_len: int = 64, test_fraction: float = 0.1) -> DataSplits:
    """The complete works (plays and poems, 5.06M characters, 84 distinct) as `text`: a contiguous
    train/validation split, the last `test_fraction` being validation. The file is built once by
    `make data` (`python -m localsgd.data.prepare shakespeare`); `path` overrides where it is."""
    from localsgd.data.prepare import SHAKESPEARE_FILE, data_dir

    file = Path(os.path.expanduser(str(path))) if path else data_dir() / SHAKESPEARE_FILE
    if not file.is_file():
        raise ConfigError(
            f"data=shakespeare needs {file}: run `make data` (or `python -m "
            f"localsgd.data.prepare shakespeare`) first, or set data.path"
        )
    return text(str(file), seq_len, test_fraction)


def cifar_folder(root: str) -> Path:
    """The folder holding the CIFAR-10 python batches: `root` or its cifar-10-batches-py."""
    base = Path(os.path.expanduser(str(root)))
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for folder in (base / _CIFAR_DIR, base) if root else ():
        if all((folder / name).is_file() for name in names):
            return folder
    raise ConfigError(
        f"data.root must be a folder holding the CIFAR-10 python batches "
        f"(cifar-10-python.tar.gz from {CIFAR_URL}, extracted), got {str(root)!r}"
    )


def cifar10(root: str, augment: bool = True) -> DataSplits:
    """CIFAR-10 from the official python batches, read by torchvision without a download.

    Train: random crop 32 with 4 pixels of padding and a horizontal flip (when `augment`), then the
    per-channel normalisation; test: the normalisation only.
    """
    import_torchvision()
    from torchvision.transforms import v2

    folder = cifar_folder(root)
    normalise = [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(CIFAR_MEAN, CIFAR_STD),
    ]
    flips = [v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()] if augment else []
    reader = __getattr__("LocalCIFAR10")
    train = reader(str(folder), train=True, transform=v2.Compose(flips + normalise))
    test = reader(str(folder), train=False, transform=v2.Compose(normalise))
    plain = reader(str(folder), train=True, transform=v2.Compose(normalise)) if augment else train
    return DataSplits(train, test, 10, (3, 32, 32), train_eval=plain)


def _local_cifar10_class():
    from torchvision import tv_tensors
    from torchvision.datasets import CIFAR10

    class LocalCIFAR10(CIFAR10):
        """torchvision's CIFAR-10 reader on `folder` itself, without the md5 check: torchvision
        checks each file against the official release, which a subset or a re-pickled copy (as
        the tests write) fails; the files' presence is checked by `cifar_folder`."""

        def __init__(self, folder: str, **kw):
            self.base_folder = os.path.basename(folder)  # read before __init__ loads the files
            super().__init__(os.path.dirname(folder), **kw)

        def _check_integrity(self) -> bool:
            return True

        def _load_meta(self) -> None:  # batches.meta, md5-checked by torchvision, holds the names
            self.classes = list(CIFAR_CLASSES)
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

        def __getitem__(self, index: int):
            # torchvision makes a PIL image of each sample first; the v2 transforms run on a
            # uint8 tensor image directly, ~40% less loading time per sample (measured here)
            image = tv_tensors.Image(torch.from_numpy(self.data[index]).permute(2, 0, 1))
            target = self.targets[index]
            return (self.transform(image) if self.transform else image), target

    # picklable by name, for DataLoader workers started by spawn or forkserver
    LocalCIFAR10.__module__, LocalCIFAR10.__qualname__ = __name__, "LocalCIFAR10"
    return LocalCIFAR10


def __getattr__(name: str):
    # torchvision is imported on first use only: the tensor sets never need it.
    if name == "LocalCIFAR10":
        if name in globals():
            return globals()[name]
        import_torchvision()
        cls = _local_cifar10_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def image_folder(
    root: str,
    image_size: int = 32,
    augment: bool = True,
    train_dir: str = "train",
    test_dir: str = "test",
) -> DataSplits:
    """Any folder of images in torchvision's ImageFolder layout: root/{train,test}/CLASS/*.png.

    Images are resized (shorter side) and centre-cropped to image_size, normalised with the
    ImageNet statistics; the train split adds a padded random crop and a horizontal flip.
    """
    import_torchvision()
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    base = Path(os.path.expanduser(str(root)))
    for sub in (train_dir, test_dir):
        if not root or not (base / sub).is_dir():
            raise ConfigError(
                f"data.root must be a folder with {train_dir}/ and {test_dir}/ subfolders of "
                f"one folder per class, got {str(root)!r}"
            )
    size = int(image_size)
    shape = [v2.Resize(size), v2.CenterCrop(size)]
    finish = [
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(_IMAGENET_MEAN, _IMAGENET_STD),
    ]
    flips = [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip()] if augment else []
    train = ImageFolder(str(base / train_dir), transform=v2.Compose(shape + flips + finish))
    test = ImageFolder(str(base / test_dir), transform=v2.Compose(shape + finish))
    if train.classes != test.classes:
        raise ConfigError(
            f"data.test_dir must hold the same class folders as data.train_dir, got "
            f"{test.classes} and {train.classes}"
        )
    plain = ImageFolder(str(base / train_dir), transform=v2.Compose(shape + finish))
    return DataSplits(train, test, len(train.classes), (3, size, size), train_eval=plain)

"""Checks that need more than the config's own values: files on disk, shard sizes, checkpoints.

They run in the launching process before any worker starts (and before Hydra writes anything
into the run directory), so a mistyped command fails in one line and touches no earlier run.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from localsgd import checkpoint
from localsgd.config import ConfigError, _get, plain

_DIGITS_SAMPLES = 1797  # scikit-learn's load_digits
_CIFAR_TRAIN = 50000
_MNIST1D_TRAIN_SPLIT = 0.8  # mnist1d's default `train_split`


def train_size(cfg: Any) -> int | None:
    """Train-set size from the data config alone (None when only loading would tell)."""
    name = _get(cfg, "data.name")
    n, tf = _get(cfg, "data.num_samples"), _get(cfg, "data.test_fraction")
    if name == "mnist1d":
        return int(n * _MNIST1D_TRAIN_SPLIT)
    if name == "digits":
        return _DIGITS_SAMPLES - math.ceil(_DIGITS_SAMPLES * tf)  # train_test_split's rounding
    if name == "synthetic":
        n_test = int(round(n * tf))
        if not 1 <= n_test < n:
            raise ConfigError(
                f"data.num_samples must leave a train and a test split at "
                f"data.test_fraction={tf}, got {n}"
            )
        return n - n_test
    if name == "cifar10":
        return _CIFAR_TRAIN
    if name == "text":
        seq = _get(cfg, "data.seq_len")
        with open(os.path.expanduser(_get(cfg, "data.path")), encoding="utf-8") as f:
            windows = len(f.read()) // (seq + 1)
        if windows < 2:
            raise ConfigError(
                f"data.path must hold at least two windows of data.seq_len+1={seq + 1} "
                f"characters, got {windows}"
            )
        return windows - max(1, min(windows - 1, int(round(windows * tf))))
    return None


def check_data(cfg: Any, world_size: int) -> None:
    name = _get(cfg, "data.name")
    if name == "cifar10":
        from localsgd.data.datasets import _CIFAR_URL, _cifar_folder

        root = str(_get(cfg, "data.root"))
        try:
            _cifar_folder(root)
        except FileNotFoundError:
            raise ConfigError(
                f"data.root must be a folder holding the CIFAR-10 python batches "
                f"(cifar-10-python.tar.gz from {_CIFAR_URL}, extracted), got {root!r}"
            ) from None
    if name == "text":
        path = str(_get(cfg, "data.path"))
        if not path or not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"data.path must name an existing text file, got {path!r}")
    n_train = train_size(cfg)
    batch = _get(cfg, "trainer.batch_size")
    if n_train is not None and _get(cfg, "data.partition") == "iid":
        shard = n_train // world_size
        if batch > shard:
            raise ConfigError(
                f"trainer.batch_size must be <= the smallest worker's shard ({shard} samples: "
                f"{n_train} train samples over {world_size} workers), got {batch}"
            )


def resolve_resume(
    cfg: Any, world_size: int, run_dir: str | None, quiet: bool = False
) -> str | None:
    found = _find_resume(cfg, world_size, run_dir, quiet)
    if found is not None:
        diff = checkpoint.config_mismatch(checkpoint.verify(found, world_size), plain(cfg))
        if diff is not None:
            raise ConfigError(
                f"trainer.resume must continue the same run, but {found} differs in {diff}; "
                f"keep those settings, or start afresh in another hydra.run.dir"
            )
    return found


def _find_resume(cfg: Any, world_size: int, run_dir: str | None, quiet: bool = False) -> str | None:
    """The checkpoint folder to start from, or None to start fresh; ConfigError if the setting
    names something unusable. `run_dir` None: not known yet (only the explicit path is checked)."""
    warn = None if quiet else _warn
    resume = _get(cfg, "trainer.resume")
    if resume not in ("auto", "never"):
        path = os.path.abspath(os.path.expanduser(resume))
        if not os.path.exists(path):
            raise ConfigError(
                f"trainer.resume must be auto, never or an existing checkpoint, got {resume!r} "
                f"(no such file or directory)"
            )
        if os.path.isdir(checkpoint.checkpoint_root(path)):  # a run directory: its newest
            found = checkpoint.newest_complete(path, world_size, warn)
            if found is None:
                raise ConfigError(
                    f"trainer.resume must name a complete checkpoint; {resume} holds none"
                )
            return found
        try:
            checkpoint.verify(path, world_size)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"trainer.resume must name a complete checkpoint; {e}") from None
        return path
    if run_dir is None:
        return None
    if resume == "never":
        if checkpoint.listed_steps(run_dir):
            raise ConfigError(
                f"trainer.resume=never but hydra.run.dir {run_dir} holds checkpoints of an "
                f"earlier run; use trainer.resume=auto or another hydra.run.dir"
            )
        return None
    found = checkpoint.newest_complete(run_dir, world_size, warn)
    if found is None and checkpoint.has_marked(run_dir):
        # Starting afresh would overwrite the earlier run's metrics and checkpoints.
        raise ConfigError(
            f"trainer.resume=auto found no usable checkpoint in {run_dir} (all are broken or "
            f"from another world size); use another hydra.run.dir"
        )
    return found


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)

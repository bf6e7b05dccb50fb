"""How finely a study's test loss can tell two models apart: the paired bootstrap over the test
samples.

Two runs' final models are evaluated on the same test split, sample by sample (a sequence's
loss is its mean over tokens); the ratio of their mean losses, less one, is what the study's
tables report, and resampling the test samples (with replacement, both models on the same
draw) gives its 95% interval. An interval wider than a target means the test set cannot
resolve that target for this pair, whatever the training did.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import default_collate

import localsgd
from localsgd.data import load_data

_DATA: dict = {}  # one copy of each run's test split (the runs of a study share it)


def test_losses(run_dir: str, batch_size: int = 256) -> np.ndarray:
    """The final model of `run_dir` on its full test split, one loss per sample."""
    config = OmegaConf.load(f"{run_dir}/.hydra/config.yaml")
    data_cfg = OmegaConf.to_container(config.data, resolve=True)
    key = (repr(data_cfg), int(config.seed))
    if key not in _DATA:
        _DATA[key] = load_data(data_cfg, int(config.seed)).test
    test = _DATA[key]
    model = localsgd.load(run_dir)
    out = []
    with torch.no_grad():
        for start in range(0, len(test), batch_size):
            end = min(start + batch_size, len(test))
            x, y = default_collate([test[i] for i in range(start, end)])
            logits = model(x).float()
            losses = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none")
            out.append(losses.view(len(y), -1).mean(1).double())
    return torch.cat(out).numpy()


def ratio_interval(
    base: np.ndarray, other: np.ndarray, draws: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """`mean(other) / mean(base) - 1` and its paired bootstrap 95% interval (lo, hi)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(base), (draws, len(base)))
    ratios = other[picks].mean(1) / base[picks].mean(1) - 1
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(other.mean() / base.mean() - 1), float(lo), float(hi)

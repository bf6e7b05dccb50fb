"""A user's own dataset: interleaved 2-D spirals, one arm per class, made from the seed.

localsgd needs an object with `train` and `test` (torch Datasets of (x, y) pairs) and
`num_classes`. These Datasets are not TensorDatasets and have no `.targets`, so localsgd streams
them through a DataLoader per rank and reads the labels for the partition in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


class Spirals(Dataset):
    def __init__(self, n: int, num_classes: int, noise: float, generator: torch.Generator):
        self.y = torch.arange(n) % num_classes
        t = torch.rand(n, generator=generator) + 0.2  # radius, and how far the arm has turned
        angle = 2 * math.pi * (0.3 * t + self.y / num_classes)  # arms curl a third of a turn
        self.x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
        self.x += noise * torch.randn(n, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


@dataclass
class SpiralData:
    train: Dataset
    test: Dataset
    num_classes: int


def make_spirals(
    num_samples: int = 2000, num_classes: int = 3, noise: float = 0.05, seed: int = 0
) -> SpiralData:
    g = torch.Generator().manual_seed(seed)  # every rank builds the same sets from the run seed
    n_test = num_samples // 5
    return SpiralData(
        Spirals(num_samples - n_test, num_classes, noise, g),
        Spirals(n_test, num_classes, noise, g),
        num_classes,
    )

"""Multi-layer perceptron over the flattened input."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self,
        input_shape: tuple[int, ...],
        hidden: Sequence[int],
        num_classes: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if any(h < 1 for h in hidden):
            raise ValueError(f"model.hidden widths must be >= 1, got {list(hidden)}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

"""A user's own model, in the user's own module: nothing in it knows about localsgd.

localsgd calls `Net(**config keys, input_shape=..., num_classes=...)`: it offers `input_shape` and
`num_classes` from the data because the signature names them.
"""

from __future__ import annotations

import math

from torch import nn


class Net(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 64):
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), width),
            nn.Tanh(),
            nn.Linear(width, width),
            nn.Tanh(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x):
        return self.body(x)

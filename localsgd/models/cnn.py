"""A small plain CNN that adapts to 1-D signals (MNIST-1D) and small images (digits, CIFAR)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# Positions kept by the final adaptive pool. Keeping a few positions (rather than a single global
# average) preserves coarse "where" information, which MNIST-1D digits depend on.
POOL_1D = 4
POOL_2D = 2


class ConvNet(nn.Module):
    """conv(k, same) -> ReLU -> MaxPool(2) per width in `channels`, adaptive pool, linear.

    input_shape (L,) is read as one channel, (C, L) uses Conv1d, (C, H, W) uses Conv2d.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        channels: Sequence[int],
        num_classes: int,
        kernel_size: int = 5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if len(input_shape) not in (1, 2, 3):
            raise ValueError(
                f"model cnn needs input (L,), (C, L) or (C, H, W), got input shape {input_shape}"
            )
        if not channels or any(c < 1 for c in channels):
            raise ValueError(
                f"model.channels must be a non-empty list of widths >= 1, got {list(channels)}"
            )
        if kernel_size < 1:
            raise ValueError(f"model.kernel_size must be >= 1, got {kernel_size}")
        self.add_channel_dim = len(input_shape) == 1
        shape = (1, *input_shape) if self.add_channel_dim else tuple(input_shape)
        two_d = len(shape) == 3
        conv = nn.Conv2d if two_d else nn.Conv1d
        pool = nn.MaxPool2d if two_d else nn.MaxPool1d
        in_ch, spatial = shape[0], list(shape[1:])

        layers: list[nn.Module] = []
        for width in channels:
            layers += [conv(in_ch, width, kernel_size, padding="same"), nn.ReLU()]
            # Stop halving once a side would drop below 2, so deep configs still run on 8x8 digits.
            if min(spatial) >= 2:
                layers.append(pool(2))
                spatial = [s // 2 for s in spatial]
            in_ch = width
        out = min(POOL_2D if two_d else POOL_1D, *spatial)
        adaptive = nn.AdaptiveAvgPool2d if two_d else nn.AdaptiveAvgPool1d
        layers += [adaptive(out), nn.Flatten()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(in_ch * out ** len(spatial), num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.add_channel_dim:
            x = x.unsqueeze(1)
        return self.net(x)

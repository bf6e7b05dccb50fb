"""ResNet-20 for CIFAR-sized images (He et al. 2016, section 4.2).

Option-A shortcuts (strided identity, zero-padded channels) keep the parameter count at the
paper's 0.27M. BatchNorm running mean/var are float buffers, so parameter averaging across
workers can average them as well; num_batches_tracked stays int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _PadShortcut(nn.Module):
    """Option A: subsample spatially and zero-pad the new channels; no parameters."""

    def __init__(self, stride: int, extra_channels: int) -> None:
        super().__init__()
        self.stride = stride
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.extra // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra - half))


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        if stride != 1 or in_ch != out_ch:
            self.shortcut: nn.Module = _PadShortcut(stride, out_ch - in_ch)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """3 stages x 3 basic blocks at 16/32/64 channels; any (C, H, W) input with H, W >= 1."""

    def __init__(self, in_channels: int, num_classes: int, blocks_per_stage: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        in_ch = 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(in_ch, width, stride))
                in_ch = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            # He init as in the paper; PyTorch's default conv init is tuned for a different gain.
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.conv(x)))
        out = self.layers(out)
        return self.fc(torch.flatten(self.pool(out), 1))

"""Callables the CLI tests name in `_target_` overrides (a module that imports no test fixture)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def no_num_classes(**kwargs) -> SimpleNamespace:
    """A dataset callable (taking any arguments) whose result lacks `num_classes`."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.zeros(8, dtype=torch.int64))
    return SimpleNamespace(train=data, test=data)

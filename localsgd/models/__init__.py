"""Model zoo: `build_model(cfg.model, input_shape, num_classes, task)` returns a plain nn.Module.

Every model is built from scratch (no pretrained weights) so that, under a fixed
`torch.manual_seed`, all workers start from bit-identical parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from localsgd.models.cnn import ConvNet
from localsgd.models.mlp import MLP
from localsgd.models.resnet import ResNet20
from localsgd.models.transformer import GPT

MODEL_NAMES = ("mlp", "cnn", "resnet20", "transformer")
TASKS = ("classification", "lm")

__all__ = ["GPT", "MLP", "MODEL_NAMES", "ConvNet", "ResNet20", "build_model"]


def _field(cfg: Any, key: str) -> Any:
    # DictConfig, dataclass and SimpleNamespace all support getattr; lists may be ListConfig.
    value = getattr(cfg, key)
    return [int(v) for v in value] if not isinstance(value, (int, float, str)) else value


def build_model(
    cfg: Any, input_shape: tuple[int, ...], num_classes: int, task: str = "classification"
) -> torch.nn.Module:
    """Build the model named by `cfg.name` for samples of `input_shape` (batch dim excluded).

    Classification models return logits (B, num_classes); `transformer` (task "lm") takes int64
    token ids (B, T) and returns (B, T, num_classes) with num_classes the vocabulary size.
    Raises ValueError (one line) for an unknown name or a model/data combination it cannot run.
    """
    name = cfg.name
    if name not in MODEL_NAMES:
        raise ValueError(f"model.name must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    input_shape = tuple(int(s) for s in input_shape)
    if num_classes < 1:
        raise ValueError(f"model {name!r} needs num_classes >= 1, got {num_classes}")
    if task == "lm" and name != "transformer":
        raise ValueError(f"model.name={name!r} cannot model text (task 'lm'); use transformer")
    dropout = float(_field(cfg, "dropout"))

    if name == "mlp":
        return MLP(input_shape, _field(cfg, "hidden"), num_classes, dropout)
    if name == "cnn":
        return ConvNet(
            input_shape,
            _field(cfg, "channels"),
            num_classes,
            int(_field(cfg, "kernel_size")),
            dropout,
        )
    if name == "resnet20":
        if len(input_shape) != 3:
            raise ValueError(
                f"model.name='resnet20' needs image input (C, H, W), got input shape {input_shape}"
            )
        return ResNet20(input_shape[0], num_classes)
    # transformer
    if task != "lm":
        raise ValueError(
            f"model.name='transformer' needs token data (task 'lm', e.g. data=text), "
            f"got task {task!r} with input shape {input_shape}"
        )
    if len(input_shape) != 1:
        raise ValueError(
            f"model.name='transformer' needs token sequences (T,), got input shape {input_shape}"
        )
    return GPT(
        vocab_size=num_classes,
        max_len=input_shape[0],
        d_model=int(_field(cfg, "d_model")),
        n_layers=int(_field(cfg, "n_layers")),
        n_heads=int(_field(cfg, "n_heads")),
        dropout=dropout,
    )

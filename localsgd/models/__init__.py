"""Model zoo: callables that `conf/model/*.yaml` names with `_target_`, and `build_model`.

A model is any callable returning an nn.Module; `build_model` instantiates the config's
`_target_` with its keys plus, where the callable's signature names them, the data's
`num_classes`, `input_shape` and `task` (and `vocab_size` for text). Every model here is built from
scratch (no pretrained weights) so that, under a fixed `torch.manual_seed`, all workers start from
bit-identical parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from localsgd.config import ConfigError
from localsgd.instantiate import build
from localsgd.models.cnn import ConvNet
from localsgd.models.mlp import MLP
from localsgd.models.resnet import ResNet20
from localsgd.models.transformer import GPT

TASKS = ("classification", "lm")

__all__ = ["GPT", "MLP", "ConvNet", "ResNet20", "build_model", "cnn", "mlp", "resnet20"]


def _classifier(name: str, task: str) -> None:
    if task != "classification":
        raise ConfigError(f"model {name} cannot model text (task {task!r}); use transformer")


def mlp(
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (256, 256),
    dropout: float = 0.0,
    task: str = "classification",
) -> MLP:
    _classifier("mlp", task)
    return MLP(tuple(input_shape), [int(h) for h in hidden], num_classes, float(dropout))


def cnn(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (32, 64),
    kernel_size: int = 5,
    dropout: float = 0.0,
    task: str = "classification",
) -> ConvNet:
    """1-D convolutions for (L,) or (C, L) input, 2-D for (C, H, W), chosen from the shape."""
    _classifier("cnn", task)
    return ConvNet(
        tuple(input_shape), [int(c) for c in channels], num_classes, int(kernel_size), dropout
    )


def resnet20(
    input_shape: Sequence[int], num_classes: int, task: str = "classification"
) -> ResNet20:
    """ResNet-20 (He et al. 2016), the CIFAR-10 model of Lin et al."""
    _classifier("resnet20", task)
    if len(input_shape) != 3:
        raise ConfigError(
            f"model resnet20 needs image input (C, H, W), got input shape {tuple(input_shape)}"
        )
    return ResNet20(int(input_shape[0]), num_classes)


def transformer(
    input_shape: Sequence[int],
    num_classes: int,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    dropout: float = 0.0,
    task: str = "lm",
) -> GPT:
    """A small GPT-style decoder over token ids (B, T); num_classes is the vocabulary size."""
    if task != "lm" or len(input_shape) != 1:
        raise ConfigError(
            f"model transformer needs token sequences (task 'lm', e.g. data=text), got task "
            f"{task!r} with input shape {tuple(input_shape)}"
        )
    return GPT(
        vocab_size=num_classes,
        max_len=int(input_shape[0]),
        d_model=int(d_model),
        n_layers=int(n_layers),
        n_heads=int(n_heads),
        dropout=float(dropout),
    )


def build_model(
    cfg: Mapping,
    input_shape: Sequence[int],
    num_classes: int,
    task: str = "classification",
) -> torch.nn.Module:
    """Instantiate `cfg._target_` for samples of `input_shape` (batch dim excluded).

    Classification models return logits (B, num_classes); text models take int64 token ids
    (B, T) and return (B, T, num_classes), num_classes being the vocabulary size.
    Raises ConfigError (one line, naming model._target_) when it does not build.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    offered = {"input_shape": tuple(int(s) for s in input_shape), "num_classes": int(num_classes)}
    offered["task"] = task
    if task == "lm":
        offered["vocab_size"] = int(num_classes)
    model = build(cfg, "model", **offered)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model._target_ must return a torch.nn.Module, got {type(model).__name__} "
            f"from {cfg['_target_']!r}"
        )
    return model

"""The inner optimizer and the learning-rate schedule (a pure function of the step)."""

from __future__ import annotations

import math

import torch


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
        )
    raise ValueError(f"optim.name must be one of sgd, adamw, got {cfg.name!r}")


def lr_at(step: int, cfg, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): a linear ramp over `lr_warmup_steps`,
    then constant, cosine down to `min_lr_ratio * lr`, or multiplied by `decay_factor` at each
    of `decay_steps`."""
    if step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "step":
        return cfg.lr * cfg.decay_factor ** sum(step >= s for s in cfg.decay_steps)
    span = max(1, max_steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

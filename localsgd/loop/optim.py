"""The inner optimizer and the learning-rate schedule, both built from `_target_` configs.

The schedule is a pure function of the optimizer step (nanoGPT's way): `schedule(step, peak)` is
the learning rate at `step` of a parameter group whose configured `lr` is `peak`, so a checkpoint
needs no scheduler state and a resumed run gets exactly the learning rate it would have had.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: Any, module: torch.nn.Module | None = None
) -> torch.optim.Optimizer:
    """`cfg._target_` (e.g. torch.optim.AdamW) called with `params` and the config's other keys,
    and with `module` too when the target says it `takes_module` (`localsgd.loop.muon.MuonAdamW`
    splits the parameters by the modules they belong to). Each parameter group remembers its
    peak `lr` as `initial_lr`, which the schedule scales."""
    from hydra.utils import get_object, instantiate

    extra = {}
    if getattr(get_object(_read(cfg, "_target_")), "takes_module", False):
        if module is None:
            raise ValueError(f"{_read(cfg, '_target_')} needs the model (module=...)")
        extra["module"] = module
    # _convert_="all": plain lists, not ListConfig (AdamW's betas)
    optimizer = instantiate(cfg, params=params, _convert_="all", **extra)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return optimizer


def _read(cfg: Any, key: str) -> Any:
    return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)


def build_schedule(cfg: Any, max_steps: int):
    """The LR schedule `cfg._target_` names, for a run of `max_steps` optimizer steps."""
    from hydra.utils import instantiate

    return instantiate(cfg, max_steps=max_steps, _convert_="all")


def _ramp(step: int, peak: float, warmup_steps: int) -> float | None:
    """Linear warmup from 0: the learning rate at `step` while it lasts, else None."""
    return peak * (step + 1) / warmup_steps if step < warmup_steps else None


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup over `warmup_steps`, then cosine from 1 down to `min_lr_ratio`."""

    max_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __call__(self, step: int, peak: float) -> float:
        ramp = _ramp(step, peak, self.warmup_steps)
        if ramp is not None:
            return ramp
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * peak
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupConstant:
    """Linear warmup over `warmup_steps`, then the peak learning rate."""

    max_steps: int
    warmup_steps: int

    def __call__(self, step: int, peak: float) -> float:
        ramp = _ramp(step, peak, self.warmup_steps)
        return peak if ramp is None else ramp


@dataclass(frozen=True)
class WarmupStep:
    """Linear warmup, then multiplied by `decay_factor` at each of `decay_steps`."""

    max_steps: int
    warmup_steps: int
    decay_steps: list[int]
    decay_factor: float

    def __call__(self, step: int, peak: float) -> float:
        ramp = _ramp(step, peak, self.warmup_steps)
        if ramp is not None:
            return ramp
        return peak * self.decay_factor ** sum(step >= s for s in self.decay_steps)


def set_lr(optimizer: torch.optim.Optimizer, schedule, step: int) -> None:
    """Every parameter group at the schedule's learning rate for `step` and its peak `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = schedule(step, group["initial_lr"])

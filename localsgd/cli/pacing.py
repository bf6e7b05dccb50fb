"""The checks of per-worker step counts (`sync.inner_time_s`) and simulated slow workers
(`comm.simulate.worker_speed`, `comm.simulate.step_s`), localsgd.loop.pacing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.config import ConfigError

BUDGET_MERGES = ("normalized", "weighted")  # localsgd.averaging.averager.Averager.normalized


def validate_pacing(cfg: Any, get: Callable[[Any, str], Any], ws: int | None) -> None:
    budget = get(cfg, "sync.inner_time_s")
    if budget is not None and not (_number(budget) and budget > 0):
        raise ConfigError(f"sync.inner_time_s must be > 0 (seconds), or null, got {budget!r}")
    merge = get(cfg, "sync.budget_merge")
    if merge is not None and merge not in BUDGET_MERGES:
        raise ConfigError(
            f"sync.budget_merge must be one of {', '.join(BUDGET_MERGES)} (or null: "
            f"normalized), got {merge!r}"
        )
    speeds = get(cfg, "comm.simulate.worker_speed")
    step = get(cfg, "comm.simulate.step_s")
    if speeds is not None:
        speeds = list(speeds)
        if not speeds or not all(_number(s) and s >= 1 for s in speeds):
            raise ConfigError(
                "comm.simulate.worker_speed must list one slowdown factor >= 1 per worker "
                f"(e.g. [1,1,1,3]), or be null, got {speeds!r}"
            )
        if ws is not None and len(speeds) != ws:
            raise ConfigError(
                f"comm.simulate.worker_speed must list one factor per worker ({ws}), got "
                f"{len(speeds)}"
            )
        if not (_number(step) and step > 0):
            raise ConfigError(
                "comm.simulate.step_s must be > 0 (the modelled seconds of one step at speed "
                f"1) with comm.simulate.worker_speed, got {step!r}"
            )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

"""The checks of per-worker step counts (`sync.inner_time_s`) and simulated slow workers
(`comm.simulate.worker_speed`, `comm.simulate.step_s`), localsgd.loop.pacing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.cli.fault_tolerance import replica_group_processes
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan

BUDGET_MERGES = ("normalized", "weighted")  # localsgd.averaging.averager.Averager.normalized

# what a weighted round cannot run with yet: key -> (the plan has it, given sync.budget_merge;
# why[; what to set instead of sync.inner_time_s=null])
NOT_WEIGHTED = {
    "sync.levels": (lambda p, c: bool(p.levels), "each level's average would need its own weights"),
    "sync.overlap": (lambda p, c: p.overlap, "an average is in flight while workers idle"),
    # Streaming DiLoCo's fragment rounds, blocking or delayed, are weighted (each fragment by
    # the samples since its values last started from the global ones)
    "sync.eager": (lambda p, c: p.eager, "each worker steps its own fresh pseudo-gradient"),
    "sync.merge_alpha": (
        lambda p, c: p.merge_alpha != 0 and c == "normalized",
        "a mixed merge leaves part of each worker's own values in its next pseudo-gradient, "
        "which the normalized merge would scale as if its samples had made it",
        "set sync.merge_alpha=0, or sync.budget_merge=weighted (which weighs it as it is)",
    ),
    "sync.outer": (
        lambda p, c: p.streaming and p.outer == "none",
        "plain streaming sends the values, not a change to scale, and its final average is "
        "one mean of the whole model, where each fragment would need its own weights",
    ),
    "sync.aggregate": (
        lambda p, c: p.gathered,
        "gathered contributions (robust aggregates, sync.score) are combined unweighted, and "
        "a weight is what a worker reports of itself, which an untrusted worker could inflate",
    ),
}


def validate_pacing(cfg: Any, get: Callable[[Any, str], Any], ws: int | None) -> None:
    budget = get(cfg, "sync.inner_time_s")
    if budget is not None and not (_number(budget) and budget > 0):
        raise ConfigError(f"sync.inner_time_s must be > 0 (seconds), or null, got {budget!r}")
    merge = get(cfg, "sync.budget_merge")
    if merge not in BUDGET_MERGES:
        raise ConfigError(
            f"sync.budget_merge must be one of {', '.join(BUDGET_MERGES)}, got {merge!r}"
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
    elif step is not None:
        raise ConfigError(
            f"comm.simulate.step_s={step} models nothing without comm.simulate.worker_speed; "
            "set both, or neither"
        )
    if budget is None:
        return
    plan = SyncPlan.of(get(cfg, "sync"))
    for key, (is_set, why, *fix) in NOT_WEIGHTED.items():
        if is_set(plan, merge):
            raise ConfigError(
                f"sync.inner_time_s with {key} ({why}) is not built; "
                f"{fix[0] if fix else 'set sync.inner_time_s=null'}"
            )
    if get(cfg, "ft.backend") == "torchft" and plan.fragments != 1:
        raise ConfigError(
            f"sync.inner_time_s with ft=torchft and sync.fragments={plan.fragments} is not "
            "built: a failed fragment round would have to put back that fragment's sample "
            "count; use sync.fragments=1, or set sync.inner_time_s=null"
        )
    if get(cfg, "ft.backend") == "torchft" and replica_group_processes() > 1:
        raise ConfigError(
            f"sync.inner_time_s with ft=torchft and replica groups of {replica_group_processes()} "
            "processes (torchrun) is not built: each worker weighs its own samples, a group "
            "would need its own weighted round inside it; run one process per replica group, "
            "or set sync.inner_time_s=null"
        )
    for key, what in (("comm.disabled", "no averages"),):
        value = get(cfg, key)
        if value not in ("none", 1, False):
            raise ConfigError(
                f"sync.inner_time_s with {key}={value} ({what}) is not built; set "
                "sync.inner_time_s=null"
            )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

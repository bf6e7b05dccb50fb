"""The checks of the untrusted workers' keys (`sync.aggregate`, `sync.score` and their
companions; `localsgd.averaging.trust`): ranges, and what they do not compose with. Called by
`localsgd.cli.checks.validate`, each a one-line ConfigError naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.averaging.robust import AGGREGATES
from localsgd.cli.fault_tolerance import replica_group_processes
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_trust(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """The keys of untrusted workers' syncs (`localsgd.averaging.trust`) and what they do not
    compose with (`SyncPlan.trust_refusal`)."""
    aggregate = get(cfg, "sync.aggregate")
    allowed = "one of " + ", ".join(AGGREGATES)
    _require(aggregate in AGGREGATES, "sync.aggregate", allowed, aggregate)
    multiple = get(cfg, "sync.clip_multiple")
    _require(_number(multiple) and multiple > 0, "sync.clip_multiple", "a number > 0", multiple)
    trim = get(cfg, "sync.trim_fraction")
    _require(_number(trim) and 0 <= trim < 0.5, "sync.trim_fraction", "in [0, 0.5)", trim)
    batch = get(cfg, "sync.score_batch")
    _require(batch >= 1, "sync.score_batch", "an integer >= 1", batch)
    fraction = get(cfg, "sync.score_fraction")
    _require(0 <= fraction < 1, "sync.score_fraction", "in [0, 1)", fraction)
    z = get(cfg, "sync.score_z")
    _require(_number(z) and z >= 0, "sync.score_z", "a number >= 0", z)
    after = get(cfg, "sync.exclude_after")
    _require(after >= 0, "sync.exclude_after", "an integer >= 0 (0 = never exclude)", after)
    window = get(cfg, "sync.exclude_window")
    _require(window is None or window >= after, "sync.exclude_window",
             f"null or an integer >= sync.exclude_after ({after})", window)  # fmt: skip
    probation = get(cfg, "sync.probation_rounds")
    _require(probation >= 0, "sync.probation_rounds", "an integer >= 0 (0 = none)", probation)
    shard = get(cfg, "sync.excluded_shard")
    _require(shard in (None, "skip", "reassign", "take_over"), "sync.excluded_shard",
             "skip, reassign, take_over or null", shard)  # fmt: skip
    moved = shard in ("reassign", "take_over")
    if moved and not (get(cfg, "sync.score") and after):
        raise ConfigError(
            f"sync.excluded_shard={shard} needs sync.score=true and sync.exclude_after >= 1: "
            "only scoring excludes a worker"
        )
    aggregate, drop = get(cfg, "sync.aggregate"), get(cfg, "sync.drop_nonfinite")
    if aggregate != "mean" and drop is False:
        raise ConfigError(
            f"sync.drop_nonfinite must be true or null with sync.aggregate={aggregate} (a "
            "robust aggregate always drops NaN/Inf contributions), got False"
        )
    if get(cfg, "sync.score") and drop is False:
        raise ConfigError(
            "sync.drop_nonfinite must be true or null with sync.score=true (a NaN/Inf "
            "contribution scores as bad and is dropped), got False"
        )
    ft = get(cfg, "ft.backend") != "none"
    plan = SyncPlan.of(get(cfg, "sync"))
    if ft and plan.gathered and replica_group_processes() > 1:
        raise ConfigError(
            f"sync.aggregate={aggregate}{' with sync.score' if get(cfg, 'sync.score') else ''} "
            f"with ft=torchft and replica groups of {replica_group_processes()} processes "
            "(torchrun) is not built: the contributions are gathered one per replica group "
            "process through the Manager; run one process per replica group"
        )
    if moved and get(cfg, "dist.shard_size") > 1:
        raise ConfigError(
            f"sync.excluded_shard={shard} with dist.shard_size > 1 is not built (an excluded "
            "worker is a replica group of ranks, each with its own data shard); use skip or null"
        )
    if ft and moved:
        raise ConfigError(
            f"sync.excluded_shard={shard} with ft=torchft is not built (a worker that heals "
            "takes a peer's sampler, and with it the peer's part of the shard); use skip or null"
        )
    wire = plan.gathered_wire(get(cfg, "sync.comm_dtype"))
    if ft and drop is True and not (wire or plan.gathered):
        raise ConfigError(
            "sync.drop_nonfinite=true cannot hold with ft=torchft and a 16/32-bit "
            "sync.comm_dtype: torchft's Manager all-reduces the mean across replica groups, "
            "which cannot leave a contribution out; use a low-bit sync.comm_dtype (int8, int4: "
            "gathered and checked) or null"
        )
    precision = get(cfg, "trainer.precision")
    if plan.gathered and plan.warmup_steps > 0 and precision == "16-mixed":
        raise ConfigError(
            f"sync.aggregate={aggregate} with sync.warmup_steps > 0 and trainer.precision=16-mixed "
            "cannot hold: the robust warmup drops an overflowed (Inf) gradient, which is the "
            "loss scaler's signal to skip the step; use bf16-mixed or 32-true"
        )
    refusal = plan.trust_refusal(ft=ft)
    if refusal is not None:
        raise ConfigError(refusal)

"""The checks of the untrusted workers' keys (`sync.aggregate`, `sync.score` and their
companions; `localsgd.averaging.trust.trusted_round`): their ranges (what they do not combine with
is a row of `localsgd.cli.refusals`). Called by `localsgd.cli.checks.validate`, each a one-line
ConfigError naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.averaging.trust.robust import AGGREGATES
from localsgd.config import ConfigError


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_trust(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """The keys of untrusted workers' syncs (`localsgd.averaging.trust.trusted_round`)."""
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

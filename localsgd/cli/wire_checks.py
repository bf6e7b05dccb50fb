"""The checks of the wire's keys: error feedback's decay and `sync.compress=topk`'s
(`localsgd.averaging.wire.sparse`) ranges; what they combine with is a row of
`localsgd.cli.refusals`. Called by `localsgd.cli.checks.validate`, each a one-line ConfigError
naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.averaging.wire.sparse import MAX_CHUNK, MEANS
from localsgd.config import ConfigError


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def validate_wire(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """Error feedback's decay and sync.compress=topk's keys."""
    decay = get(cfg, "sync.error_feedback_decay")
    _require(0 < decay <= 1, "sync.error_feedback_decay", "in (0, 1]", decay)
    topk_mean = get(cfg, "sync.topk_mean")
    _require(topk_mean in MEANS, "sync.topk_mean", " or ".join(MEANS), topk_mean)
    if get(cfg, "sync.compress") != "topk":
        return
    density, chunk = get(cfg, "sync.topk_density"), get(cfg, "sync.topk_chunk")
    _require(0 < density <= 1, "sync.topk_density", "in (0, 1]", density)
    _require(2 <= chunk <= MAX_CHUNK, "sync.topk_chunk", f"an integer in [2, {MAX_CHUNK}]", chunk)

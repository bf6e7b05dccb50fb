"""The checks of the wire's keys: error feedback and its decay, and `sync.compress=topk`
(`localsgd.averaging.sparse`): what each needs or replaces. Called by
`localsgd.cli.checks.validate`, each a one-line ConfigError naming the key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.averaging.sparse import MAX_CHUNK, MEANS
from localsgd.config import ConfigError


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def validate_wire(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """Error feedback (and its decay) and sync.compress=topk: what each needs or replaces."""
    ef, dtype = bool(get(cfg, "sync.error_feedback")), get(cfg, "sync.comm_dtype")
    decay = get(cfg, "sync.error_feedback_decay")
    allowed = "in (0, 1], and 1 with sync.error_feedback=false"
    _require(0 < decay <= 1 and (ef or decay == 1), "sync.error_feedback_decay", allowed, decay)
    if get(cfg, "sync.compress") != "topk":
        allowed = "false with sync.comm_dtype=float32 and sync.compress=none (nothing is rounded)"
        _require(not ef or dtype != "float32", "sync.error_feedback", allowed, ef)
        return
    density, chunk = get(cfg, "sync.topk_density"), get(cfg, "sync.topk_chunk")
    _require(0 < density <= 1, "sync.topk_density", "in (0, 1]", density)
    _require(2 <= chunk <= MAX_CHUNK, "sync.topk_chunk", f"an integer in [2, {MAX_CHUNK}]", chunk)
    topk_mean = get(cfg, "sync.topk_mean")
    _require(topk_mean in MEANS, "sync.topk_mean", " or ".join(MEANS), topk_mean)
    allowed = "all with sync.aggregate=median or trimmed_mean (per coordinate, not per sender)"
    _require(topk_mean == "all" or get(cfg, "sync.aggregate") in ("mean", "clip"),
             "sync.topk_mean", allowed, topk_mean)  # fmt: skip
    allowed = "float32 with sync.compress=topk (top-k sends its own 2-bit values)"
    _require(dtype == "float32", "sync.comm_dtype", allowed, dtype)
    allowed = "true with sync.compress=topk (without it the values not sent are lost)"
    _require(ef, "sync.error_feedback", allowed, ef)

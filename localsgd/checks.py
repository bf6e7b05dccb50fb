"""Range and combination checks of the `sync`, `optim` and `lr_schedule` configs, called from
`localsgd.config.validate` (one-line ConfigErrors naming the key, as everywhere)."""

from __future__ import annotations

from typing import Any

from localsgd.config import ConfigError, _choice, _get, _require

__all__ = ["ConfigError", "validate_optim", "validate_sync"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _importable(cfg: Any, key: str, what: str) -> None:
    """`key._target_` names something hydra.utils.instantiate can import."""
    target = _get(cfg, f"{key}._target_") if _has(cfg, f"{key}._target_") else None
    ok = isinstance(target, str) and callable(_locate(target))
    _require(ok, f"{key}._target_", f"the import path of {what}", target)


def _locate(path: str) -> Any:
    """The object at a dotted import path (as `_target_` names it), or None. Quiet, unlike
    hydra.utils.get_object, which logs an error before raising."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _has(cfg: Any, key: str) -> bool:
    try:
        _get(cfg, key)
    except Exception:  # a missing key: AttributeError, KeyError, OmegaConf's own errors
        return False
    return True


def validate_optim(cfg: Any) -> None:
    """The optimizer and LR schedule configs: targets that import, and the ranges of the
    keyword arguments torch's optimizers share (checked where the config has them)."""
    _importable(cfg, "optim", "an optimizer class (e.g. torch.optim.SGD)")
    lr = _get(cfg, "optim.lr") if _has(cfg, "optim.lr") else None
    _require(_number(lr) and lr > 0, "optim.lr", "a number > 0", lr)
    if _has(cfg, "optim.momentum"):
        momentum = _get(cfg, "optim.momentum")
        _require(_number(momentum) and 0 <= momentum < 1, "optim.momentum", "in [0, 1)", momentum)
        if _has(cfg, "optim.nesterov") and _get(cfg, "optim.nesterov"):
            _require(momentum > 0, "optim.nesterov", "false when optim.momentum is 0", True)
    if _has(cfg, "optim.weight_decay"):
        wd = _get(cfg, "optim.weight_decay")
        _require(_number(wd) and wd >= 0, "optim.weight_decay", ">= 0", wd)
    if _has(cfg, "optim.betas"):
        betas = list(_get(cfg, "optim.betas"))
        _require(
            len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas),
            "optim.betas",
            "two numbers in [0, 1)",
            betas,
        )
    _importable(cfg, "lr_schedule", "a schedule (e.g. localsgd.optim.WarmupCosine)")
    for key, allowed, ok in (
        ("lr_schedule.warmup_steps", "an integer >= 0", lambda v: isinstance(v, int) and v >= 0),
        ("lr_schedule.min_lr_ratio", "in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
        ("lr_schedule.decay_factor", "a number > 0", lambda v: _number(v) and v > 0),
    ):
        if _has(cfg, key):
            value = _get(cfg, key)
            _require(ok(value), key, allowed, value)


SCHEDULES = ("constant", "step", "adaptive")
OUTERS = ("none", "diloco", "slowmo")
OPTIMIZER_STATES = ("local", "average", "reset")
COMM_DTYPES = ("float32", "bfloat16", "float16")


def _validate_overlap(cfg: Any, has_levels: bool) -> None:
    """Delayed averaging is built for plain periodic averaging only."""
    bucket = _get(cfg, "sync.bucket_mb")
    _require(bucket > 0, "sync.bucket_mb", "> 0", bucket)
    _require(not has_levels, "sync.overlap", "false when sync.levels is set", True)
    for key, allowed in (
        ("sync.outer", "none"),
        ("sync.comm_dtype", "float32"),
        ("sync.optimizer_state", "local"),
    ):
        value = _get(cfg, key)
        _require(value == allowed, key, f"{allowed} when sync.overlap=true", value)
    schedule = _get(cfg, "sync.schedule")
    _require(
        schedule != "adaptive", "sync.schedule", "constant or step when sync.overlap=true", schedule
    )


def validate_sync(cfg: Any, ws: int | None, local_ws: int | None) -> None:
    """The averaging strategy's keys and their combinations. `ws` None: not known yet."""
    for key, choices in (
        ("sync.schedule", SCHEDULES),
        ("sync.outer", OUTERS),
        ("sync.optimizer_state", OPTIMIZER_STATES),
        ("sync.comm_dtype", COMM_DTYPES),
    ):
        _choice(cfg, key, choices)
    schedule = _get(cfg, "sync.schedule")
    factor = _get(cfg, "sync.period_factor")
    period = _get(cfg, "sync.period")
    if schedule == "step":
        _require(factor >= 1, "sync.period_factor", "an integer >= 1", factor)
        milestones = list(_get(cfg, "sync.period_milestones"))
        _require(
            all(m >= 0 for m in milestones), "sync.period_milestones", "steps >= 0", milestones
        )
    if schedule == "adaptive":
        _require(factor >= 2, "sync.period_factor", "an integer >= 2 for adaptive", factor)
        lo, hi = _get(cfg, "sync.min_period"), _get(cfg, "sync.max_period")
        _require(lo >= 1, "sync.min_period", "an integer >= 1", lo)
        _require(
            lo <= period <= hi, "sync.max_period", f">= sync.period ({period}) >= min_period", hi
        )
        tol = _get(cfg, "sync.adaptive_tolerance")
        _require(0 <= tol < 1, "sync.adaptive_tolerance", "in [0, 1)", tol)
    outer_lr = _get(cfg, "sync.outer_lr")
    _require(outer_lr is None or outer_lr > 0, "sync.outer_lr", "> 0 (or null)", outer_lr)
    outer_momentum = _get(cfg, "sync.outer_momentum")
    _require(
        outer_momentum is None or 0 <= outer_momentum < 1,
        "sync.outer_momentum",
        "in [0, 1) (or null)",
        outer_momentum,
    )
    if _get(cfg, "sync.outer_nesterov") and outer_momentum == 0:
        _require(False, "sync.outer_nesterov", "false when sync.outer_momentum is 0", True)

    levels = list(_get(cfg, "sync.levels") or [])
    if _get(cfg, "sync.overlap"):
        _validate_overlap(cfg, bool(levels))
    if not levels:
        return
    outer = _get(cfg, "sync.outer")
    _require(outer == "none", "sync.outer", "none when sync.levels is set", outer)
    _require(schedule == "constant", "sync.schedule", "constant when sync.levels is set", schedule)
    sizes, periods = [], []
    for i, level in enumerate(levels):
        size, lp = _get(level, "group_size"), _get(level, "period")
        key = f"sync.levels[{i}]"
        ok = size in ("world", "node") or (isinstance(size, int) and size >= 1)
        _require(ok, f"{key}.group_size", "an integer >= 1, node or world", size)
        _require(isinstance(lp, int) and lp >= 1, f"{key}.period", "an integer >= 1", lp)
        if size == "world":
            size = ws
        elif size == "node":
            size = local_ws if local_ws is not None else ws
        sizes.append(size)
        periods.append(lp)
    if ws is not None:
        for i, size in enumerate(sizes):
            _require(
                ws % size == 0, f"sync.levels[{i}].group_size", f"a divisor of {ws} workers", size
            )
    # torch's rule, nothing stricter: the last listed level whose period divides the step wins
    for i in range(1, len(levels)):
        _require(
            periods[i] not in periods[:i],
            f"sync.levels[{i}].period",
            f"different from the other levels' periods {periods[:i]}",
            periods[i],
        )
        grows = sizes[i] is None or sizes[i - 1] is None or sizes[i] >= sizes[i - 1]
        if _get(cfg, "sync.comm_dtype") != "float32":
            _require(
                grows,
                f"sync.levels[{i}].group_size",
                f">= the previous level's {sizes[i - 1]} with sync.comm_dtype other than float32",
                sizes[i],
            )
    if ws is not None:
        _require(
            sizes[-1] == ws,
            f"sync.levels[{len(levels) - 1}].group_size",
            f"world (the widest level spans all {ws} workers)",
            sizes[-1],
        )

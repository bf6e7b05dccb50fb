"""The checks of a config's values: ranges, choices and combinations, each a one-line
ConfigError naming the key and what is allowed. `validate` runs in the launching process before
any worker starts (`localsgd.cli.train`) and calls the others: the `ft` keys' checks live with
the supervisor (`localsgd.cli.fault_tolerance.validate_ft`), `dist.shard_size`'s in
`localsgd.cli.sharding`, the untrusted workers' in `localsgd.cli.trust_checks` and the wire's
(error feedback, top-k) in `localsgd.cli.wire_checks`; the override and data/model checks
that need more than the values are `localsgd.cli.overrides` and `localsgd.cli.preflight`. What
the sync keys mean together is read once, by `localsgd.loop.plan.SyncPlan`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from localsgd.averaging import COMM_DTYPES, OPTIMIZER_STATE_MODES
from localsgd.averaging.asynchronous.heloco import RANGES as HELOCO_RANGES
from localsgd.averaging.asynchronous.heloco import STALENESS_CORRECTIONS
from localsgd.averaging.asynchronous.heloco import describe as describe_range
from localsgd.averaging.offload import OUTER_STATES
from localsgd.averaging.streaming.averager import MERGE_RULES
from localsgd.cli.fault_tolerance import check_lighthouse, validate_ft
from localsgd.cli.pacing import validate_pacing
from localsgd.cli.refusals import check as check_refusals
from localsgd.cli.sharding import validate_sharding
from localsgd.cli.trust_checks import validate_trust
from localsgd.cli.virtual import validate_virtual
from localsgd.cli.wire_checks import validate_wire
from localsgd.config import (
    ASYNC_MODES,
    BACKENDS,
    COMPRESSIONS,
    DEVICES,
    ConfigError,
    data_options,
)
from localsgd.data.loader import LOADERS
from localsgd.data.partition import PARTITIONS
from localsgd.loop.guards import NAN_POLICIES
from localsgd.loop.loggers import WANDB_MODES
from localsgd.loop.plan import SyncPlan
from localsgd.loop.recipe import PRECISIONS
from localsgd.loop.strategies import GROUP_SIZE_WORDS, OUTERS, SCHEDULES, resolve_group_size

__all__ = ["ConfigError", "validate", "validate_optim", "validate_sync"]


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")


def _choice(cfg: Any, key: str, choices: Iterable[str]) -> None:
    """`key` is one of `choices`, the table of the module that implements them."""
    value = _get(cfg, key)
    _require(value in choices, key, "one of " + ", ".join(choices), value)


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if isinstance(node, dict):
            node = node[part]
        elif part.isdigit():  # an item of a list (trainer.callbacks.0)
            node = node[int(part)]
        else:
            node = getattr(node, part)
    return node


def validate(cfg: Any, world_size: int | None = None, local_world_size: int | None = None) -> None:
    """Raise ConfigError on the first setting out of range. `cfg` is a DictConfig or a plain dict.

    `world_size` is the real one under torchrun; otherwise `dist.world_size` will be spawned.
    """
    validate_virtual(cfg, _get)  # first: it decides the world size
    ws = world_size if world_size is not None else _get(cfg, "dist.world_size")
    _require(ws is None or ws >= 1, "dist.world_size", "an integer >= 1 (or null for auto)", ws)
    _choice(cfg, "dist.backend", BACKENDS)
    _choice(cfg, "dist.device", DEVICES)
    timeout = _get(cfg, "dist.timeout_s")
    _require(timeout > 0, "dist.timeout_s", "> 0 seconds", timeout)

    _validate_length(cfg)
    for key in (
        *(("trainer.max_steps",) if _get(cfg, "trainer.max_steps") is not None else ()),
        "trainer.batch_size",
        "trainer.eval_every",
        "trainer.log_every",
        "trainer.eval_batch_size",
        "sync.period",
    ):
        value = _get(cfg, key)
        _require(value >= 1, key, "an integer >= 1", value)
    for key in ("trainer.checkpoint_every",):
        value = _get(cfg, key)
        _require(value >= 0, key, "an integer >= 0 (0 = no checkpoints)", value)
    keep = _get(cfg, "trainer.keep_checkpoints")
    _require(keep >= 1, "trainer.keep_checkpoints", "an integer >= 1", keep)
    subset = _get(cfg, "trainer.eval_samples")
    _require(
        subset is None or subset >= 1, "trainer.eval_samples", "an integer >= 1 or null", subset
    )
    chars = _get(cfg, "trainer.sample_chars")
    _require(chars >= 0, "trainer.sample_chars", "an integer >= 0 (0 = no sample)", chars)
    _choice(cfg, "trainer.nan_policy", NAN_POLICIES)
    _choice(cfg, "trainer.precision", PRECISIONS)
    accumulate = _get(cfg, "trainer.accumulate_grad_batches")
    _require(accumulate >= 1, "trainer.accumulate_grad_batches", "an integer >= 1", accumulate)
    clip = _get(cfg, "trainer.gradient_clip_val")
    _require(
        clip is None or clip >= 0,
        "trainer.gradient_clip_val",
        ">= 0 (0 or null: no clipping)",
        clip,
    )
    resume = _get(cfg, "trainer.resume")
    _require(
        isinstance(resume, str) and resume != "",
        "trainer.resume",
        "auto, never or the path of a checkpoint folder",
        resume,
    )
    warmup = _get(cfg, "sync.warmup_steps")
    _require(
        warmup >= 0,
        "sync.warmup_steps",
        "an integer >= 0 (0 = local SGD from the first step)",
        warmup,
    )

    validate_sync(cfg, ws, local_world_size)
    validate_sharding(cfg, _get, ws, local_world_size)
    validate_pacing(cfg, _get, ws)
    bandwidth = _get(cfg, "comm.simulate.bandwidth_gbps")
    _require(
        bandwidth is None or bandwidth > 0,
        "comm.simulate.bandwidth_gbps",
        "> 0 (Gbit/s), or null for no limit",
        bandwidth,
    )
    latency = _get(cfg, "comm.simulate.latency_ms")
    _require(latency >= 0, "comm.simulate.latency_ms", ">= 0", latency)

    validate_optim(cfg)
    validate_ft(cfg, _get, ws)
    for i, _ in enumerate(_get(cfg, "trainer.callbacks") or ()):
        _importable(cfg, f"trainer.callbacks.{i}", "a callback (on_step_start/on_step_end)")
    if _get(cfg, "logger.wandb.mode") is not None:
        _choice(cfg, "logger.wandb.mode", WANDB_MODES)

    data_options(_get(cfg, "data"))  # each of localsgd's own data keys has its type
    _choice(cfg, "data.partition", PARTITIONS)
    _choice(cfg, "data.loader", LOADERS)
    alpha = _get(cfg, "data.alpha")
    _require(alpha > 0, "data.alpha", "> 0", alpha)
    cpw = _get(cfg, "data.classes_per_worker")
    _require(cpw >= 1, "data.classes_per_worker", "an integer >= 1", cpw)
    workers = _get(cfg, "data.num_workers")
    _require(workers >= 0, "data.num_workers", "an integer >= 0 (0 = load in the rank)", workers)
    check_refusals(cfg, _get)  # what does not combine: one table (localsgd.cli.refusals)
    check_lighthouse(cfg, _get)


def _validate_length(cfg: Any) -> None:
    """Exactly one of trainer.max_steps and trainer.max_epochs says how long to train."""
    steps, epochs = _get(cfg, "trainer.max_steps"), _get(cfg, "trainer.max_epochs")
    if steps is not None and epochs is not None:
        raise ConfigError(
            f"trainer.max_epochs must be null when trainer.max_steps is set (got {epochs} and "
            f"max_steps={steps}); add trainer.max_steps=null to train for epochs"
        )
    if steps is None and epochs is None:
        raise ConfigError("trainer.max_steps must be set, or trainer.max_epochs, got both null")
    if epochs is not None:
        _require(epochs >= 1, "trainer.max_epochs", "an integer >= 1", epochs)


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
    _importable(cfg, "lr_schedule", "a schedule (e.g. localsgd.loop.optim.WarmupCosine)")
    for key, allowed, ok in (
        ("lr_schedule.warmup_steps", "an integer >= 0", lambda v: isinstance(v, int) and v >= 0),
        ("lr_schedule.min_lr_ratio", "in [0, 1]", lambda v: _number(v) and 0 <= v <= 1),
        ("lr_schedule.decay_factor", "a number > 0", lambda v: _number(v) and v > 0),
    ):
        if _has(cfg, key):
            value = _get(cfg, key)
            _require(ok(value), key, allowed, value)


def _validate_streaming(cfg: Any, plan: SyncPlan) -> None:
    """Fragments, a delayed or mixed merge, the eager outer step, an outer optimizer over
    levels (`StreamingAverager`; with levels, the widest level is the streaming one)."""
    fragments, period, period_key = plan.fragments, plan.period, plan.period_key
    _require(fragments >= 1, "sync.fragments", "an integer >= 1", fragments)
    _require(
        period % fragments == 0,
        "sync.fragments",
        f"a divisor of {period_key} ({period}): each fragment syncs every period, offset by "
        "period/fragments",
        fragments,
    )
    delay, spacing, alpha = plan.delay, plan.spacing, plan.merge_alpha
    _require(
        0 <= delay <= spacing,
        "sync.delay_steps",
        f"in [0, {period_key}/sync.fragments] = [0, {spacing}]",
        delay,
    )
    _require(0 <= alpha < 1, "sync.merge_alpha", "in [0, 1)", alpha)


def validate_sync(cfg: Any, ws: int | None, local_ws: int | None) -> None:
    """The averaging strategy's keys and their combinations. `ws` None: not known yet."""
    for key, choices in (
        ("sync.mode", ASYNC_MODES),
        ("sync.compress", COMPRESSIONS),
        ("sync.schedule", SCHEDULES),
        ("sync.outer", OUTERS),
        ("sync.optimizer_state", OPTIMIZER_STATE_MODES),
        ("sync.comm_dtype", COMM_DTYPES),
        ("sync.merge_rule", MERGE_RULES),
        ("sync.outer_state", OUTER_STATES),
    ):
        _choice(cfg, key, choices)
    bucket = _get(cfg, "sync.bucket_mb")
    _require(bucket > 0, "sync.bucket_mb", "> 0 (MiB)", bucket)
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
    warm = _get(cfg, "sync.outer_warmup_rounds")
    _require(warm >= 0, "sync.outer_warmup_rounds", "an integer >= 0", warm)
    quorum = _get(cfg, "sync.min_quorum")
    shard = _get(cfg, "dist.shard_size")
    # sharded replica groups: each group is one worker
    groups = ws // shard if ws is not None and isinstance(shard, int) and shard > 1 else ws
    workers = "workers" if groups == ws else f"replica groups of {shard} ranks"
    _require(
        isinstance(quorum, int) and quorum >= 1 and (groups is None or quorum <= groups),
        "sync.min_quorum", f"an integer in [1, {groups if groups is not None else 'world size'}] "
        f"(the {f'{groups} ' if groups is not None else ''}{workers})", quorum,
    )  # fmt: skip
    grace = _get(cfg, "sync.grace_s")
    _require(grace is None or grace >= 0, "sync.grace_s",
             ">= 0 (seconds), or null (one step of the slowest worker)", grace)  # fmt: skip
    stale = _get(cfg, "sync.max_staleness")
    _require(stale is None or (isinstance(stale, int) and stale >= 0), "sync.max_staleness",
             "an integer >= 0 (merges), or null (every contribution merged)", stale)  # fmt: skip
    _choice(cfg, "sync.staleness_correction", STALENESS_CORRECTIONS)
    for name, allowed in HELOCO_RANGES.items():
        value = _get(cfg, f"sync.heloco.{name}")
        low, high = allowed
        _require(low <= value <= high, f"sync.heloco.{name}", describe_range(allowed), value)
    delay = _get(cfg, "sync.outer_delay")
    _require(delay is None or (isinstance(delay, int) and delay >= 1), "sync.outer_delay",
             "an integer >= 1 (or null: the number of workers)", delay)  # fmt: skip

    block = _get(cfg, "sync.quant_block_size")
    _require(block >= 1, "sync.quant_block_size", "an integer >= 1", block)
    validate_wire(cfg, _get)
    validate_trust(cfg, _get)
    levels = list(_get(cfg, "sync.levels") or [])
    if _get(cfg, "sync.optimizer_state") == "desloc":
        mp = list(_get(cfg, "sync.moment_periods"))
        _require(len(mp) == 2 and all(isinstance(p, int) and p >= 1 for p in mp),
                 "sync.moment_periods", "two integers >= 1 ([first, second] moment periods, in "
                 "parameter averages)", mp)  # fmt: skip
    plan = SyncPlan.of(_get(cfg, "sync"))
    streaming = plan.streaming
    if streaming:  # what the plan builds a StreamingAverager for
        _validate_streaming(cfg, plan)
    if not levels:
        return
    # sharded replica groups: a level's group_size counts replica groups (one worker each), as
    # the averages span one rank per group (`localsgd.loop.build_sync`)
    shard = _get(cfg, "dist.shard_size")
    shard = shard if isinstance(shard, int) and shard >= 1 else 1
    what = "workers" if shard == 1 else f"replica groups of {shard} ranks"
    if ws is not None:
        ws = ws // shard if ws % shard == 0 else ws
    if local_ws is not None:
        local_ws = max(1, local_ws // shard)
    sizes, periods = [], []
    for i, level in enumerate(levels):
        size, lp = _get(level, "group_size"), _get(level, "period")
        key = f"sync.levels[{i}]"
        ok = size in GROUP_SIZE_WORDS or (isinstance(size, int) and size >= 1)
        words = " or ".join(GROUP_SIZE_WORDS)
        _require(ok, f"{key}.group_size", f"an integer >= 1, {words}", size)
        _require(isinstance(lp, int) and lp >= 1, f"{key}.period", "an integer >= 1", lp)
        sizes.append(resolve_group_size(size, ws, local_ws))  # None: ws not known yet
        periods.append(lp)
    if ws is not None:
        for i, size in enumerate(sizes):
            _require(
                ws % size == 0, f"sync.levels[{i}].group_size", f"a divisor of {ws} {what}", size
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
        lossy = _get(cfg, "sync.comm_dtype") != "float32" or _get(cfg, "sync.compress") != "none"
        if lossy and not streaming:  # streaming: inner levels in fp32
            _require(grows, f"sync.levels[{i}].group_size", f">= the previous level's "
                     f"{sizes[i - 1]} with sync.comm_dtype below float32 or sync.compress=topk",
                     sizes[i])  # fmt: skip
    if ws is not None:
        _require(
            sizes[-1] == ws,
            f"sync.levels[{len(levels) - 1}].group_size",
            f"world (the widest level spans all {ws} {what})",
            sizes[-1],
        )

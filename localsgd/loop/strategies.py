"""The averaging strategy a `sync` config asks for, built in one place: `build_averager`.

`sync.mode=async` gives an `AsyncAverager` (its fragments, its inner levels); otherwise
Streaming DiLoCo's keys (and an outer optimizer over `sync.levels`) give a `StreamingAverager`,
whose widest level is the streaming one; `sync.levels` otherwise a `HierarchicalAverager`;
`sync.outer` (diloco | slowmo) an `OuterAverager`; otherwise a `PeriodicAverager`, each with
the period schedule, the communication precision and the optimizer-state policy the config
names. What the config means is read once, by `localsgd.loop.plan.SyncPlan`, which the checks
(`localsgd.cli.checks.validate`, run before any worker starts) read too; the averagers check
their own arguments again. The loop sees the strategy through `localsgd.loop.synchroniser`.

A new strategy touches `localsgd/averaging/` (an averager for a new rule of *when*, or one
stage's choice in `localsgd/averaging/rounds/` for a new *what*: a combine rule is an entry of
`robust.RULES`, a wire a codec), `build_averager` here, the plan, the `SyncConfig` schema with
its checks (`localsgd/config.py`, `localsgd/cli/checks.py`; a combination that cannot work is a
row of `localsgd/cli/refusals.py`) and a `conf/sync/` preset; nothing in the trainer
(docs/strategies.md, "Adding a strategy").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from localsgd.averaging import (
    OUTER_DEFAULTS,
    AdaptivePeriod,
    Averager,
    CommStats,
    ConstantPeriod,
    HierarchicalAverager,
    NeverAverage,
    OptimizerStateSync,
    OuterAverager,
    PeriodicAverager,
    SimulatedLink,
    StepPeriod,
    StreamingAverager,
)
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.config import SyncConfig
from localsgd.loop.plan import SyncPlan, strategy_name  # noqa: F401  (strategy_name re-exported)

# A level's `group_size` may name one of these instead of an integer.
GROUP_SIZE_WORDS = ("node", "world")


def resolve_group_size(value: Any, world_size: int, local_world_size: int | None) -> int:
    """A level's `group_size`: an integer, `world` (every rank) or `node` (torchrun's
    LOCAL_WORLD_SIZE: the processes on one machine; without it, every rank)."""
    if value == "world":
        return world_size
    if value == "node":
        return world_size if local_world_size is None else local_world_size
    return int(value)


SCHEDULES: dict[str, Callable[[SyncConfig, int], ConstantPeriod]] = {
    "constant": lambda sync, period: ConstantPeriod(period),
    "step": lambda sync, period: StepPeriod(
        period, sync.period_factor, list(sync.period_milestones)
    ),
    "adaptive": lambda sync, period: AdaptivePeriod(
        period,
        min_period=sync.min_period,
        max_period=sync.max_period,
        factor=sync.period_factor,
        tolerance=sync.adaptive_tolerance,
    ),
}

# `sync.outer`: none, or an outer optimizer with the papers' defaults
OUTERS = ("none", *OUTER_DEFAULTS)


def build_schedule(sync: SyncConfig, period: int | None = None) -> ConstantPeriod:
    """The `sync.schedule` of the widest level's period (`period`; None: `sync.period`)."""
    return SCHEDULES[sync.schedule](sync, sync.period if period is None else period)


def aggregate_of(sync: SyncConfig) -> Aggregate:
    """The `sync.aggregate` rule with its keys (`localsgd.averaging.trust.robust`)."""
    return Aggregate(sync.aggregate, sync.clip_multiple, sync.trim_fraction)


def trust_of(
    sync: SyncConfig, plan: SyncPlan, loss_at: Callable[[int], float] | None
) -> dict[str, Any]:
    """The `aggregate` and `judge` arguments of the averager
    (`localsgd.averaging.trust.trusted_round`): none for the all-reduced mean."""
    if not plan.gathered:
        return {}
    judge = None
    if plan.score:
        if loss_at is None:
            raise ValueError("sync.score needs the held-out loss (loss_at)")
        judge = Judge(
            loss_at,
            sync.exclude_after,
            sync.score_fraction,
            sync.score_z,
            exclude_window=sync.exclude_window,
            probation_rounds=sync.probation_rounds,
            batch=sync.score_batch,
        )
    return {
        "aggregate": aggregate_of(sync),
        "judge": judge,
    }


def build_averager(
    sync: SyncConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world_size: int,
    local_world_size: int,
    stats: CommStats,
    link: SimulatedLink | None = None,
    communicate: bool = True,
    process_group: dist.ProcessGroup | None = None,
    loss_at: Callable[[int], float] | None = None,
    asynchronous: dict[str, Any] | None = None,
) -> Averager:
    """The averager the `sync` config asks for, its optimizer-state hook attached; a simulated
    slow `link` applies to every collective it makes. Every rank starts from rank 0's model.
    `communicate=False`: one that never averages (the no-communication baseline).
    `process_group`: the ranks to average with, `world_size` of them (sharded replica groups:
    the ranks holding the same shard; None: every rank). `loss_at(round)`: the model's loss on
    round `round`'s held-out batch, for `sync.score`. `asynchronous`: what `sync.mode=async`
    needs beyond the config (`AsyncAverager`'s store, run_id, max_steps, step_seconds,
    meet_every, timeout_s)."""
    plan = SyncPlan.of(sync)
    trust = trust_of(sync, plan, loss_at)
    # a budget's rounds weigh each worker by the samples it reports, except under a robust rule,
    # which combines the contributions unweighted (an untrusted worker could inflate its report)
    weighted = sync.inner_time_s is not None and not plan.gathered
    # a budget's normalized merge scales each change since the last average: the values kept
    normalized = weighted and sync.budget_merge != "weighted"  # null: normalized
    comm_dtype = plan.comm_format(sync.comm_dtype)  # a name, or top-k's codec
    levels = list(sync.levels)
    outer = sync.outer
    outer_step = {
        "outer_lr": plan.outer_lr,
        "outer_momentum": plan.outer_momentum,
        "outer_nesterov": plan.outer_nesterov,
        "outer_warmup_rounds": sync.outer_warmup_rounds,
        "outer_state": sync.outer_state,
    }
    if not communicate:
        return PeriodicAverager(
            1,
            process_group=process_group,
            module=model,
            stats=stats,
            schedule=NeverAverage(),
            link=link,
            init_sync=True,
        )
    sizes = {
        int(lv.period): resolve_group_size(lv.group_size, world_size, local_world_size)
        for lv in levels
    }
    # the wire every averager sends through (`localsgd.averaging.rounds.wire`)
    wire = {
        "comm_dtype": comm_dtype,
        "error_feedback": plan.error_feedback,
        "error_feedback_decay": sync.error_feedback_decay,
        "quant_block_size": sync.quant_block_size,
        "drop_nonfinite": plan.drop_nonfinite,
    }
    if plan.streaming and plan.mode != "async":  # asynchronous fragments: `AsyncAverager`
        # with levels, the widest is the streaming one; the others average the whole model
        outer_step = outer_step if outer != "none" else {}  # plain streaming has no outer step
        averager = StreamingAverager(
            plan.period,
            sync.warmup_steps,
            process_group,
            module=model,
            stats=stats,
            link=link,
            fragments=sync.fragments,
            delay_steps=plan.delay,
            merge_alpha=plan.merge_alpha,
            merge_rule=plan.merge_rule,
            bucket_mb=sync.bucket_mb,
            eager=plan.eager,
            outer=outer != "none",
            **outer_step,
            init_sync=True,
            **wire,
            inner_levels=dict(list(sizes.items())[:-1]),
            schedule=build_schedule(sync, plan.period),
            round_starts=normalized,
            **trust,  # robust rounds over each fragment
        )
    elif plan.mode == "async":
        from localsgd.averaging.asynchronous import AsyncAverager
        from localsgd.averaging.asynchronous.heloco import RANGES as HELOCO_RANGES
        from localsgd.averaging.asynchronous.heloco import HeLoCo

        if outer == "none":  # plain averaging: the outer step is `anchor - mean(change)`
            outer_step.update(outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
        momentum = outer_step["outer_momentum"]
        # N defaults to the workers (under ft=torchft each is a world of its own: `workers`)
        workers = (asynchronous or {}).get("workers") or world_size
        delay = sync.outer_delay if sync.outer_delay is not None else workers
        averager = AsyncAverager(
            plan.period,
            sync.warmup_steps,
            process_group,
            module=model,
            stats=stats,
            **outer_step,
            link=link,
            min_quorum=sync.min_quorum,
            grace_s=sync.grace_s,
            # Delayed Nesterov where there is momentum to delay; N = 1 is torch's SGD itself
            outer_delay=delay if momentum and delay > 1 else None,
            inner_time_s=sync.inner_time_s,
            **wire,
            aggregate=trust.get("aggregate"),
            normalized_merges=sync.budget_merge != "weighted",
            max_staleness=sync.max_staleness,
            fragments=sync.fragments,
            # where phases by steps end (constant, step; adaptive: as the syncer says)
            schedule=build_schedule(sync, plan.period),
            inner_levels=dict(list(sizes.items())[:-1]),  # synchronous inside each group
            # an exchange in flight while the worker trains on, and how its answer lands
            delay_steps=plan.delay,
            merge_rule=plan.merge_rule,
            merge_alpha=plan.merge_alpha,
            correction=(
                HeLoCo(**{k: getattr(sync.heloco, k) for k in HELOCO_RANGES})
                if sync.staleness_correction == "heloco"
                else None
            ),
            **(asynchronous or {}),
        )
        weighted = normalized = False  # the syncer weighs every contribution by its samples
    elif levels:
        averager = HierarchicalAverager(
            sizes,
            sync.warmup_steps,
            process_group,
            module=model,
            stats=stats,
            **wire,
            link=link,
            init_sync=True,
            schedule=build_schedule(sync, plan.period),
            round_starts=normalized,
        )
    elif outer != "none":
        averager = OuterAverager(
            sync.period,
            sync.warmup_steps,
            process_group,
            module=model,
            stats=stats,
            **outer_step,
            schedule=build_schedule(sync),
            **wire,
            link=link,
            **trust,
        )  # anchored: it starts from rank 0's model
    else:
        averager = PeriodicAverager(
            sync.period,
            sync.warmup_steps,
            process_group,
            module=model,
            stats=stats,
            schedule=build_schedule(sync),
            **wire,
            link=link,
            init_sync=True,
            round_starts=normalized,
            **trust,
        )
    # a time budget (`sync.inner_time_s`): each round weighs every worker by the samples it
    # trained on, its change first scaled to the round's most samples under the normalized merge
    averager.weighted, averager.normalized = weighted, normalized
    mode = sync.optimizer_state
    if mode != "local":
        averager.hooks.append(OptimizerStateSync(optimizer, mode, plan.moment_periods))
    return averager


def optimizer_state_bytes(averager: Averager) -> dict[str, int]:
    """`comm_bytes_<state>`: what this worker sent of each optimizer state (`exp_avg`,
    `exp_avg_sq`, ...) under sync.optimizer_state=average | desloc; empty otherwise."""
    out: dict[str, int] = {}
    for hook in averager.hooks:
        if isinstance(hook, OptimizerStateSync):
            out.update({f"comm_bytes_{k}": v for k, v in hook.bytes_by_state.items()})
    return out

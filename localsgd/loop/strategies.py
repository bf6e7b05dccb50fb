"""The synchronisation strategy, built from the `sync` and `comm` configs in one place.

`Synchroniser` is all the trainer knows of it: the synchronous warmup's gradient averaging, the
model averager, the no-communication baseline (a schedule that never averages), drift measured
around the averages that bring every replica together, and what the summary reports.

Streaming DiLoCo's keys (and an outer optimizer over `sync.levels`) give a `StreamingAverager`,
whose widest level is the streaming one; `sync.levels` otherwise a `HierarchicalAverager`;
`sync.outer` (diloco | slowmo) an `OuterAverager`; otherwise a `PeriodicAverager`, each with
the period schedule, the communication precision and the optimizer-state policy the config
names. `localsgd.cli.checks.validate` has already refused
bad combinations, reading the tables of allowed values defined here and in the averaging core;
the averagers check their own arguments again.

A new strategy touches `localsgd/averaging/` (its averager or reducer), `build_averager` here, the
`SyncConfig` schema with its checks (`localsgd/config.py`, `localsgd/cli/checks.py`) and a
`conf/sync/` preset; nothing in the trainer.
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
    GradientAverager,
    HierarchicalAverager,
    NeverAverage,
    OptimizerStateSync,
    OuterAverager,
    PeriodicAverager,
    SimulatedLink,
    StepPeriod,
    StreamingAverager,
)
from localsgd.config import CommConfig, SyncConfig
from localsgd.loop.drift import DriftMeter
from localsgd.loop.guards import check_replicas
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


SCHEDULES: dict[str, Callable[[SyncConfig], ConstantPeriod]] = {
    "constant": lambda sync: ConstantPeriod(sync.period),
    "step": lambda sync: StepPeriod(sync.period, sync.period_factor, list(sync.period_milestones)),
    "adaptive": lambda sync: AdaptivePeriod(
        sync.period,
        min_period=sync.min_period,
        max_period=sync.max_period,
        factor=sync.period_factor,
        tolerance=sync.adaptive_tolerance,
    ),
}

# `sync.outer`: none, or an outer optimizer with the papers' defaults
OUTERS = ("none", *OUTER_DEFAULTS)


def build_schedule(sync: SyncConfig) -> ConstantPeriod:
    return SCHEDULES[sync.schedule](sync)


def build_averager(
    sync: SyncConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world_size: int,
    local_world_size: int,
    stats: CommStats,
    link: SimulatedLink | None = None,
    communicate: bool = True,
) -> Averager:
    """The averager the `sync` config asks for, its optimizer-state hook attached; a simulated
    slow `link` applies to every collective it makes. Every rank starts from rank 0's model.
    `communicate=False`: one that never averages (the no-communication baseline)."""
    plan = SyncPlan.of(sync)
    comm_dtype = sync.comm_dtype
    levels = list(sync.levels)
    outer = sync.outer
    outer_step = {
        "outer_lr": plan.outer_lr,
        "outer_momentum": plan.outer_momentum,
        "outer_nesterov": plan.outer_nesterov,
        "outer_warmup_rounds": sync.outer_warmup_rounds,
    }
    if not communicate:
        return PeriodicAverager(
            1, module=model, stats=stats, schedule=NeverAverage(), link=link, init_sync=True
        )
    sizes = {
        int(lv.period): resolve_group_size(lv.group_size, world_size, local_world_size)
        for lv in levels
    }
    if plan.streaming:
        # with levels, the widest is the streaming one; the others average the whole model
        outer_step = outer_step if outer != "none" else {}  # plain streaming has no outer step
        averager = StreamingAverager(
            plan.period,
            sync.warmup_steps,
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
            comm_dtype=comm_dtype,
            quant_block_size=sync.quant_block_size,
            error_feedback=sync.error_feedback,
            inner_levels=dict(list(sizes.items())[:-1]),
        )
    elif levels:
        averager = HierarchicalAverager(
            sizes,
            sync.warmup_steps,
            module=model,
            stats=stats,
            comm_dtype=comm_dtype,
            link=link,
            init_sync=True,
            error_feedback=sync.error_feedback,
            quant_block_size=sync.quant_block_size,
        )
    elif outer != "none":
        averager = OuterAverager(
            sync.period,
            sync.warmup_steps,
            module=model,
            stats=stats,
            **outer_step,
            schedule=build_schedule(sync),
            comm_dtype=comm_dtype,
            link=link,
            error_feedback=sync.error_feedback,
            quant_block_size=sync.quant_block_size,
        )  # anchored: it starts from rank 0's model
    else:
        averager = PeriodicAverager(
            sync.period,
            sync.warmup_steps,
            module=model,
            stats=stats,
            schedule=build_schedule(sync),
            comm_dtype=comm_dtype,
            link=link,
            init_sync=True,
            error_feedback=sync.error_feedback,
            quant_block_size=sync.quant_block_size,
        )
    mode = sync.optimizer_state
    if mode != "local":
        averager.hooks.append(OptimizerStateSync(optimizer, mode))
    return averager


class Synchroniser:
    """How the workers' replicas are kept together, as the training loop calls it.

    Around each optimizer step the loop calls `zero_grad`, `after_backward` (the warmup's
    gradient all-reduce; returns whether to step) and `after_step` (the model average when the
    schedule says). Between them it asks `in_sync` / `merged` (whether the replicas, or what
    they received, are identical now), `next_sync` and `common_tensors`.
    """

    def __init__(
        self,
        averager: Averager,
        model: torch.nn.Module,
        max_steps: int,
        grad_averager: GradientAverager | None = None,
        drift: DriftMeter | None = None,
        verify: bool = False,
    ):
        self.averager = averager
        self.verify = verify  # check after each sync that the replicas are bit-identical
        self.replica_checks = 0
        self.model = model
        self.max_steps = max_steps
        self.grad_averager = grad_averager
        self.drift = drift
        if drift is not None:
            averager.global_hooks.append(drift)
        self.stats = averager.stats  # every collective's counters, the warmup's included
        self.in_sync = True  # the replicas are identical right now
        self.synchronous = False  # the step being taken belongs to the synchronous warmup
        # ft=torchft: the averages (and the warmup's gradient averages) as torchft rounds
        # (localsgd.loop.fault_tolerance); None: straight through torch.distributed
        self.ft = None

    @property
    def rounds(self):
        """What runs the averages: the averager, or its torchft round driver."""
        return self.averager if self.ft is None else self.ft

    @property
    def warmup_steps(self) -> int:
        return self.averager.warmup_steps

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step is synchronous (gradients averaged)."""
        return self.averager.in_warmup

    @property
    def merged(self) -> bool:
        """With a delayed average: the last step applied one (what every rank received is
        identical; the replicas differ by their local progress since it was launched)."""
        return self.averager.merged

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # In the warmup the gradients are views of GradientAverager's flat buffer: zero them in
        # place. Afterwards drop them: zeroing and then accumulating into old gradients costs two
        # extra passes over the model per step (~10% of a step for a 10M MLP on CPU).
        optimizer.zero_grad(set_to_none=not self.in_warmup)

    def after_backward(self, skip: bool) -> bool:
        """The gradients are ready (zeroed if `skip`, a non-finite loss under nan_policy=skip).
        In the warmup they are averaged: plain mini-batch SGD. Returns whether to step: a
        skipping rank still steps in the warmup (on the others' gradients), or replicas split."""
        self.synchronous = self.in_warmup
        if self.synchronous:
            if self.ft is not None:  # False: the round failed, every replica skips the step
                return self.ft.all_reduce_gradients()
            self.grad_averager.all_reduce()
            return True
        return not skip

    def after_step(self, loss: torch.Tensor | None) -> None:
        """After the optimizer step: feed the loss (None: the step was skipped) to a schedule
        that adapts to it, then average when the schedule says."""
        if loss is not None:
            self.averager.observe_loss(loss)
        self.rounds.maybe_average()
        self.in_sync = self.synchronous or self.averager.all_in_sync

    def next_sync(self, step: int) -> int | None:
        """The first step index >= `step` after which the replicas are together again (a warmup
        step, or an average over every rank), or None if none is left."""
        nxt = step if step < self.warmup_steps else self.averager.next_sync(step)
        return nxt if nxt is not None and nxt < self.max_steps else None

    def common_tensors(self, step: int) -> list[torch.Tensor]:
        """What every rank holds identically after step `step`, which was a sync."""
        if step < self.warmup_steps:
            # the warmup keeps only the parameters identical (BatchNorm statistics stay local
            # until the first average)
            return list(self.model.parameters())
        return self.averager.common_tensors()

    def check_replicas(self, step: int, rank: int) -> None:
        """With `sync.check_replicas`: fail unless every rank holds the same `common_tensors`
        after step `step`, a sync (one gather; off by default)."""
        if self.verify and self.ft is None:  # under torchft: checked inside each round
            check_replicas(self.common_tensors(step), step, rank)
            self.replica_checks += 1

    @property
    def checks_done(self) -> int:
        """Syncs checked bit-identical so far (`sync.check_replicas`): the summary reports it,
        so that a mode the check would skip cannot pass for a checked one."""
        return self.ft.replica_checks if self.ft is not None else self.replica_checks

    def finish(self) -> None:
        """The final model is the average of the replicas: average once more if the last step
        was a local one (never in the no-communication baseline); with `sync.check_replicas`
        the final model is checked too (under torchft: inside the final round)."""
        if not self.in_sync and self.averager.ever_averages:
            self.rounds.average()
            self.in_sync = True
            self.check_replicas(self.averager.step - 1, dist.get_rank())

    def summary(self) -> dict[str, Any]:
        """The strategy as run: the period of the average over every rank at the end (None if
        it never averages), the warmup, and each level's communication."""
        averager = self.averager
        widest = len(averager.levels) - 1
        summary = {
            "period": averager.period_of(widest) if averager.ever_averages else None,
            "warmup_steps": self.warmup_steps,
            "comm_levels": averager.comm_levels(),
        }
        if self.verify:
            summary["replica_checks"] = self.checks_done
        if self.ft is not None:
            summary.update(self.fault_record(), **self.ft_counters())
        return summary

    def fault_record(self) -> dict[str, Any]:
        """Under ft=torchft: how many workers the last average included (every log line)."""
        return {} if self.ft is None else {"participants": self.ft.participants}

    def ft_counters(self) -> dict[str, Any]:
        ft = self.ft
        return {
            "participants_min": ft.participants_min,
            "heals": ft.heals_seen,  # of any worker, counted alike by every worker
            "failed_syncs": ft.failed_syncs,
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the strategy, by the names checkpoints use."""
        state = {"averager": self.averager, "comm": self.stats}
        if self.drift is not None:
            state["drift"] = self.drift
        return state


def build_synchroniser(
    sync: SyncConfig,
    comm: CommConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world_size: int,
    local_world_size: int,
    max_steps: int,
    track_drift: bool = True,
    fault_tolerant: bool = False,
) -> Synchroniser:
    """The `sync` config's strategy over the `comm` config's network (a simulated slow link,
    or no communication at all), for `model` trained by `optimizer`."""
    sim = comm.simulate
    link = (
        SimulatedLink(sim.bandwidth_gbps, sim.latency_ms)
        if sim.bandwidth_gbps is not None or sim.latency_ms > 0
        else None
    )
    stats = CommStats()
    averager = build_averager(
        sync,
        model,
        optimizer,
        world_size,
        local_world_size,
        stats,
        link,
        communicate=not comm.disabled,
    )
    # the averager gave every rank rank 0's model already
    grad_averager = (
        GradientAverager(model, stats=stats, link=link, init_sync=False)
        if sync.warmup_steps > 0
        else None
    )
    # under torchft the process group is the worker alone: drift would measure nothing
    measure = track_drift and not comm.disabled and not fault_tolerant
    drift = DriftMeter(averager.flat.buffers) if measure else None
    return Synchroniser(
        averager, model, max_steps, grad_averager, drift, verify=sync.check_replicas
    )

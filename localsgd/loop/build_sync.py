"""Building the `Synchroniser` from the config: the averager the `sync` config asks for over the
`comm` config's network, the synchronous warmup's gradient averaging, drift, and, under
`ft=torchft`, the fault tolerance; with the notices a config earns at the start."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from localsgd.averaging import CommStats, GradientAverager, SimulatedLink
from localsgd.averaging.asynchronous.links import SYNCER_ENV
from localsgd.config import Config
from localsgd.loop.drift import DriftMeter
from localsgd.loop.local_rounds import LocalRounds
from localsgd.loop.metrics import notice
from localsgd.loop.plan import SyncPlan
from localsgd.loop.strategies import aggregate_of, build_averager, resolve_group_size
from localsgd.loop.synchroniser import Synchroniser
from localsgd.loop.worker import WorkerInfo

if TYPE_CHECKING:
    from localsgd.loop.fsdp import Sharding


def build_synchroniser(
    cfg: Config,
    info: WorkerInfo,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sharding: Sharding | None = None,
    held_out: Callable[..., float] | None = None,
    store: dist.Store | None = None,
) -> Synchroniser:
    """The `sync` config's strategy over the `comm` config's network (a simulated slow link,
    or no communication at all), for `model` trained by `optimizer`; under `ft=torchft` its
    syncs across replica groups go through torchft (torchft is imported only then). With
    `sharding` (dist.shard_size > 1) it averages each shard across the replica groups.
    `store`: the rendezvous store (asynchronous rounds' messages go through it)."""
    sync, comm, fault_tolerant = cfg.sync, cfg.comm, cfg.ft.backend != "none"
    sim = comm.simulate
    link = (
        SimulatedLink(sim.bandwidth_gbps, sim.latency_ms)
        if sim.bandwidth_gbps is not None or sim.latency_ms > 0
        else None
    )
    # under torchft the process group is one replica group: levels are sized within it
    group = dist.get_world_size() if fault_tolerant else info.world_size
    replicas = sharding.replicate_group if sharding is not None else None
    shards = sharding.shard_group if sharding is not None else None
    if sharding is not None:
        group //= sharding.size  # the averages span one rank per replica group
    stats = CommStats()
    # a machine's replica groups (sync.levels' group_size: node)
    local = min(info.local_world_size // (sharding.size if sharding is not None else 1), group)
    averager = build_averager(
        sync,
        model,
        optimizer,
        group,
        local,
        stats,
        link,
        communicate=not comm.disabled,
        process_group=replicas,
        # sync.score: the model's loss on a round's held-out batch (or its samples)
        loss_at=None
        if held_out is None
        else (lambda round_, samples=None: held_out(round_, sync.score_batch, samples)),
        asynchronous=_asynchronous(cfg, info, store, sharding) if sync.mode == "async" else None,
    )
    buffers = averager.flat.buffers
    wall_clock = sim.worker_speed is None or fault_tolerant  # the syncer's order: arrivals
    if (
        sync.mode == "async"
        and wall_clock
        and sync.grace_s == 0
        and info.world_size > 1
        and info.rank == 0
    ):
        notice(
            "sync.mode=async on the wall clock with sync.grace_s=0: every contribution is merged "
            "alone, so workers that arrive together each train on a different global model "
            "(measured on the Shakespeare LM: test loss 2.61 against 1.93 with sync.grace_s=0.25; "
            "docs/asynchronous.md); a window about as wide as their arrivals' spread merges them "
            "together"
        )
    if sync.outer_state == "cpu" and info.rank == 0 and buffers and buffers[0].device.type == "cpu":
        notice(
            "sync.outer_state=cpu on a CPU run saves nothing: the anchors and outer momentum "
            "were in host memory already (the outer step still runs through its host staging)"
        )
    # torch accepts an inner level as wide as the widest; say so, as it averages everyone
    inner = [
        i for i, level in enumerate(sync.levels[:-1])
        if resolve_group_size(level.group_size, group, local) == group
    ]  # fmt: skip
    if inner and info.rank == 0:
        notice(
            f"sync.levels{inner}: group_size spans all {group} "
            f"{'workers' if sharding is None else 'replica groups'}, so those inner averages are "
            "global ones (an inner level needs a group_size below that)"
        )
    plan = SyncPlan.of(sync)
    gathered = plan.gathered_wire(sync.comm_dtype) or plan.gathered
    torchft_rounds = fault_tolerant and sync.mode != "async"  # asynchronous: sessions
    if torchft_rounds and info.rank == 0 and averager.comm.guard and not gathered:
        notice(
            "sync.drop_nonfinite: under ft=torchft the full-precision mean across replica groups "
            "is torchft's all-reduce, which leaves no NaN/Inf contribution out (a low-bit "
            "sync.comm_dtype is gathered and checked)"
        )
    # the rules that outvote a minority, and what they are without one
    outvoted = {"median": "the mean of what was sent", "trimmed_mean": "the mean of what was sent",
                "sign": "a tie wherever the two disagree"}  # fmt: skip
    if sync.aggregate in outvoted and group < 3 and info.rank == 0 and not fault_tolerant:
        notice(
            f"sync.aggregate={sync.aggregate} with {group} worker{'s' if group > 1 else ''} "
            f"(sharded: replica groups) outvotes nobody: it is {outvoted[sync.aggregate]} "
            "(an honest majority needs at least 3; sync.aggregate=clip still bounds each change)"
        )
    if plan.score and sync.exclude_after and group < 3 and info.rank == 0 and not fault_tolerant:
        notice(
            f"sync.score with {group} worker{'s' if group > 1 else ''}: nobody can be excluded "
            "(an honest majority needs at least 3; sharded, 3 replica groups); a contribution "
            "judged bad is still dropped from its round"
        )
    # the averager gave every rank rank 0's model already
    # sharded: over the replicate group (FSDP averaged inside each group already), so HSDP
    # untrusted workers: the warmup's gradients combined by the robust rule too; under the mean
    # a NaN/Inf gradient is left out in band (`sync.drop_nonfinite`), but not under fp16 loss
    # scaling, whose every scaler must see an overflow to skip the step together
    guard = plan.drop_nonfinite and cfg.trainer.precision != "16-mixed"
    grad_averager = (
        GradientAverager(model, replicas, stats=stats, link=link, init_sync=False,
                         drop_nonfinite=guard,
                         aggregate=aggregate_of(sync) if sync.aggregate != "mean" else None)
        if sync.warmup_steps > 0
        else None
    )  # fmt: skip
    # under torchft the mean across replica groups is the Manager's: the drift is measured in
    # its rounds (`RoundDriftMeter`), not in asynchronous sessions nor at a delayed merge, which
    # follows its round's commit (an explicit trainer.track_drift=true there is refused)
    measure = cfg.trainer.track_drift is not False and not comm.disabled
    measure = measure and not (fault_tolerant and (sync.mode == "async" or averager.delayed_syncs))
    on_torch = measure and not fault_tolerant
    drift = DriftMeter(averager.flat.buffers, replicas, shards) if on_torch else None
    # the round driver: the averager's syncs straight through torch.distributed, or, under
    # ft=torchft, as rounds of torchft's Manager (the same methods; torchft imported only then)
    driver = LocalRounds(averager, grad_averager)
    if fault_tolerant and sync.mode == "async":  # no quorum to run: sessions with the syncer
        from localsgd.loop.async_sessions import AsyncSessions

        driver = AsyncSessions(
            averager, info.rank, cfg.seed, info.attempt, verify=sync.check_replicas
        )
    elif fault_tolerant:
        from localsgd.loop.fault_tolerance import FaultTolerance

        driver = FaultTolerance.build(
            cfg.ft,
            info,
            cfg.seed,
            averager,
            grad_averager,
            sync.check_replicas,
            sharded=sharding is not None and sharding.sharded,
            batch=cfg.trainer.batch_size * cfg.trainer.accumulate_grad_batches,
            drift=(replicas, shards) if measure else None,
        )
        drift = driver.drift
    return Synchroniser(
        averager,
        model,
        cfg.trainer.max_steps,
        driver,
        grad_averager,
        drift,
        verify=sync.check_replicas,
        group=replicas,
        sharding=sharding,
    )


def _asynchronous(
    cfg: Config, info: WorkerInfo, store: dist.Store | None, sharding: Sharding | None
) -> dict:
    """`AsyncAverager`'s arguments beyond the sync config: the store its messages go through,
    the run's attempt (their keys), the meetings (checkpoint steps and the last) and this
    worker's modelled speed (`comm.simulate.worker_speed`, `step_s`; none: the wall clock). A
    sharded replica group is one worker: it runs at its slowest rank's speed, as its ranks
    compute a tick together.
    Under `ft=torchft` the syncer is the launcher's (`hosted`): the worker joins it at the
    address the launcher gives, on the wall clock (the modelled one would wait on every
    worker's announced times, a dead one's too)."""
    sim = cfg.comm.simulate
    speeds = sim.worker_speed
    common = {
        "store": store,
        "run_id": str(info.attempt),
        "max_steps": cfg.trainer.max_steps,
        "timeout_s": cfg.dist.timeout_s,
        "meet_every": cfg.trainer.checkpoint_every,
    }
    if cfg.ft.backend != "none":
        hosted = {"syncer_address": os.environ[SYNCER_ENV], "worker": info.rank}
        return {**common, **hosted, "workers": info.world_size}
    if store is None:
        raise ValueError("sync.mode=async needs the rendezvous store")
    group = range(info.rank, info.rank + 1)
    if sharding is not None and sharding.sharded:
        first = info.rank - info.rank % sharding.size
        group = range(first, first + sharding.size)
    return {
        **common,
        "step_s": sim.step_s if speeds else None,
        "speed": max(float(speeds[r]) for r in group) if speeds else 1.0,
    }

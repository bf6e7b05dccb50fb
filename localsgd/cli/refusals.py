"""One table of what does not combine: each row the keys, the condition, why, and the fix.

Every refusal of a combination of settings is a row of `REFUSALS`, checked in one place (`check`,
from `localsgd.cli.checks.validate`) before any worker starts, after each key's own value was
checked. A combination stays refused only where it means nothing (`MEANINGLESS`), needs what
this machine or a library does not have (`UNAVAILABLE`), or asks a question of design that a
row answers by refusing (`DESIGN`); each row says which. Everything else composes by
construction: the sync round is one pipeline of stages (`localsgd.averaging.rounds`), whatever
the schedule, wire, combine, outer step, merge or transport.

docs/configuration.md shows the table as `markdown()` writes it (tests/test_refusals.py keeps the
two equal: `python -m localsgd.cli.refusals` prints it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localsgd.averaging.trust.robust import AGGREGATES, COORDINATE_RULES
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan

PER_COORDINATE_NAMES = " or ".join(COORDINATE_RULES)  # the rules that judge each coordinate
MEANINGLESS = "meaningless"
UNAVAILABLE = "unavailable here"
DESIGN = "design"


@dataclass(frozen=True)
class Facts:
    """What the rows read: the sync plan and the rest of the run, from the config."""

    plan: SyncPlan
    delay_set: int  # sync.delay_steps as set (sync.overlap reads as 1)
    comm_dtype: str
    ft: bool
    torchrun: bool
    group_processes: int  # the processes of one replica group under torchrun with ft
    shard_size: int
    virtual: bool
    budget: bool  # sync.inner_time_s
    modelled_clock: bool  # comm.simulate.worker_speed
    step_s: bool  # comm.simulate.step_s set
    link: bool  # comm.simulate.bandwidth_gbps or latency_ms
    comm_disabled: bool
    drop_nonfinite: bool | None  # as set: None means true
    budget_merge: str | None  # null: normalized
    precision: str
    nan_policy: str
    excluded_shard: str | None
    exclude_after: int
    error_feedback: bool
    decay: float
    topk_mean: str
    outer_state: str
    outer_warmup_rounds: int
    retry_failed: bool
    min_replicas: int
    checkpoint_every: int
    staleness_correction: str
    max_staleness: int | None
    syncer_keys: bool  # sync.min_quorum > 1, sync.grace_s or sync.outer_delay set
    lighthouse: bool  # ft.lighthouse names a running one
    replica_groups: bool  # ft.replica_groups set (torchrun: one replica group per machine)
    warmup_steps: int
    track_drift: bool | None  # as set: None measures wherever there is a mean
    heartbeat_gate: bool | None  # as set: None gates wherever a lighthouse runs

    @classmethod
    def of(cls, cfg: Any, get: Callable[[Any, str], Any]) -> Facts:
        from localsgd.cli.fault_tolerance import replica_group_processes
        from localsgd.cli.forkserver import under_torchrun

        plan = SyncPlan.of(get(cfg, "sync"))
        return cls(
            plan=plan,
            delay_set=get(cfg, "sync.delay_steps"),
            comm_dtype=get(cfg, "sync.comm_dtype"),
            ft=get(cfg, "ft.backend") != "none",
            torchrun=under_torchrun(),
            group_processes=replica_group_processes(),
            shard_size=get(cfg, "dist.shard_size"),
            virtual=get(cfg, "dist.virtual_workers") is not None,
            budget=get(cfg, "sync.inner_time_s") is not None,
            modelled_clock=get(cfg, "comm.simulate.worker_speed") is not None,
            step_s=get(cfg, "comm.simulate.step_s") is not None,
            link=get(cfg, "comm.simulate.bandwidth_gbps") is not None
            or get(cfg, "comm.simulate.latency_ms") > 0,
            comm_disabled=bool(get(cfg, "comm.disabled")),
            drop_nonfinite=get(cfg, "sync.drop_nonfinite"),
            budget_merge=get(cfg, "sync.budget_merge"),
            precision=get(cfg, "trainer.precision"),
            nan_policy=get(cfg, "trainer.nan_policy"),
            excluded_shard=get(cfg, "sync.excluded_shard"),
            exclude_after=get(cfg, "sync.exclude_after"),
            error_feedback=plan.error_feedback,  # resolved: null is on with top-k
            decay=get(cfg, "sync.error_feedback_decay"),
            topk_mean=get(cfg, "sync.topk_mean"),
            outer_state=get(cfg, "sync.outer_state"),
            outer_warmup_rounds=get(cfg, "sync.outer_warmup_rounds"),
            retry_failed=bool(get(cfg, "ft.retry_failed_sync")),
            min_replicas=int(get(cfg, "ft.min_replicas") or 1),
            checkpoint_every=get(cfg, "trainer.checkpoint_every"),
            staleness_correction=get(cfg, "sync.staleness_correction"),
            max_staleness=get(cfg, "sync.max_staleness"),
            syncer_keys=get(cfg, "sync.min_quorum") != 1
            or get(cfg, "sync.grace_s") is not None
            or get(cfg, "sync.outer_delay") is not None,
            lighthouse=bool(get(cfg, "ft.lighthouse")),
            replica_groups=get(cfg, "ft.replica_groups") is not None,
            warmup_steps=get(cfg, "sync.warmup_steps"),
            track_drift=get(cfg, "trainer.track_drift"),
            heartbeat_gate=get(cfg, "ft.heartbeat_gate"),
        )

    @property
    def lossy(self) -> bool:
        """A wire below fp32 that rounds what it sends (error feedback has something to keep)."""
        return self.comm_dtype != "float32" or self.plan.compress != "none"

    @property
    def moves_shards(self) -> bool:
        return self.excluded_shard in ("reassign", "take_over")


@dataclass(frozen=True)
class Refusal:
    """One row: `condition` (as the docs show it, naming the keys) holds when `when(facts)`;
    `why` (`kind`: MEANINGLESS, UNAVAILABLE or DESIGN) and the `fix`."""

    keys: tuple[str, ...]
    condition: str
    when: Callable[[Facts], bool]
    kind: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.condition}: {self.why}; {self.fix}"


def _gathered(f: Facts) -> bool:
    return f.plan.gathered


REFUSALS: tuple[Refusal, ...] = (
    # --- the round's own stages ------------------------------------------------------------------
    Refusal(
        ("sync.eager", "sync.delay_steps"),
        "sync.eager=true with sync.delay_steps > 0",
        lambda f: f.plan.eager and f.plan.delay > 0,
        MEANINGLESS,
        "an eager outer step already takes each round's mean one round late, so it needs no "
        "delayed merge",
        "set sync.delay_steps=0",
    ),
    Refusal(
        ("sync.eager", "sync.outer"),
        "sync.eager=true with sync.outer=none",
        lambda f: f.plan.eager and f.plan.outer == "none",
        MEANINGLESS,
        "eager updates step an outer optimizer, and there is none",
        "set sync.outer=diloco",
    ),
    Refusal(
        ("sync.overlap", "sync.delay_steps", "sync.merge_alpha"),
        "sync.overlap=true with sync.delay_steps > 1 or sync.merge_alpha > 0",
        lambda f: f.plan.overlap and (f.delay_set not in (0, 1) or f.plan.merge_alpha != 0),
        MEANINGLESS,
        "sync.overlap is shorthand for sync.delay_steps=1 sync.merge_rule=progress, which keeps "
        "each worker's progress instead of mixing",
        "drop sync.overlap and set sync.delay_steps, sync.merge_rule and sync.merge_alpha",
    ),
    Refusal(
        ("sync.merge_rule", "sync.delay_steps"),
        "sync.merge_rule=progress with sync.delay_steps=0",
        lambda f: f.plan.merge_rule == "progress" and f.plan.delay == 0,
        MEANINGLESS,
        "a blocking round has no progress since its launch to keep",
        "set sync.delay_steps >= 1, or sync.merge_rule=mix",
    ),
    Refusal(
        ("sync.merge_rule", "sync.merge_alpha"),
        "sync.merge_rule=progress with sync.merge_alpha > 0",
        lambda f: f.plan.merge_rule == "progress" and f.plan.merge_alpha != 0,
        MEANINGLESS,
        "the progress rule replaces the values by the global ones plus this worker's progress; "
        "there is nothing to mix",
        "set sync.merge_alpha=0, or sync.merge_rule=mix",
    ),
    Refusal(
        ("sync.outer_warmup_rounds", "sync.outer"),
        "sync.outer_warmup_rounds > 0 with sync.outer=none",
        lambda f: f.outer_warmup_rounds > 0 and f.plan.outer == "none",
        MEANINGLESS,
        "there is no outer step to warm up",
        "set sync.outer_warmup_rounds=0",
    ),
    Refusal(
        ("sync.outer_state", "sync.outer"),
        "sync.outer_state=cpu with sync.outer=none",
        lambda f: f.outer_state == "cpu" and f.plan.outer == "none",
        MEANINGLESS,
        "there is no anchor or outer momentum to keep",
        "set sync.outer_state=device",
    ),
    Refusal(
        ("sync.error_feedback", "sync.comm_dtype", "sync.compress"),
        "sync.error_feedback=true with sync.comm_dtype=float32 and sync.compress=none",
        lambda f: f.error_feedback and not f.lossy,
        MEANINGLESS,
        "nothing is rounded, so nothing is fed back",
        "set a lower sync.comm_dtype (int4, bfloat16, ...), sync.compress=topk, or "
        "sync.error_feedback=false",
    ),
    Refusal(
        ("sync.error_feedback_decay", "sync.error_feedback"),
        "sync.error_feedback_decay < 1 with sync.error_feedback=false",
        lambda f: f.decay != 1 and not f.error_feedback,
        MEANINGLESS,
        "there is no residual to decay",
        "set sync.error_feedback=true, or the decay to 1",
    ),
    Refusal(
        ("sync.compress", "sync.comm_dtype"),
        "sync.compress=topk with sync.comm_dtype other than float32",
        lambda f: f.plan.compress == "topk" and f.comm_dtype != "float32",
        MEANINGLESS,
        "top-k sends its own 2-bit values, there is no second wire format",
        "set sync.comm_dtype=float32",
    ),
    Refusal(
        ("sync.compress", "sync.error_feedback"),
        "sync.compress=topk with sync.error_feedback=false",
        lambda f: f.plan.compress == "topk" and not f.error_feedback,
        DESIGN,
        "the values top-k does not send would be lost for good, not delayed",
        "set sync.error_feedback=true",
    ),
    Refusal(
        ("sync.compress", "sync.aggregate"),
        f"sync.compress=topk with sync.aggregate={PER_COORDINATE_NAMES}",
        lambda f: f.plan.compress == "topk" and f.plan.aggregate in COORDINATE_RULES,
        MEANINGLESS,
        "most indices hold one worker's value and the others' zeros, so a per-coordinate rule "
        "discards what was sent",
        "use sync.aggregate=clip, or mean with sync.score=true (synchronous rounds)",
    ),
    Refusal(
        ("sync.topk_mean", "sync.aggregate"),
        f"sync.topk_mean=senders with sync.aggregate={PER_COORDINATE_NAMES}",
        lambda f: f.topk_mean == "senders" and f.plan.aggregate in COORDINATE_RULES,
        MEANINGLESS,
        "a per-coordinate rule has no senders to divide by",
        "set sync.topk_mean=all",
    ),
    # --- untrusted workers -----------------------------------------------------------------------
    Refusal(
        ("sync.aggregate", "sync.score", "sync.levels"),
        "sync.aggregate other than mean, or sync.score=true, with sync.levels",
        lambda f: _gathered(f) and bool(f.plan.levels),
        MEANINGLESS,
        "an inner level's plain mean carries one worker's contribution into its whole group "
        "before a robust round could judge it, and small groups have no honest majority",
        "make a worker of several devices one replica group (dist.shard_size), judged as one",
    ),
    Refusal(
        ("sync.aggregate", "sync.score", "sync.eager"),
        "sync.aggregate other than mean, or sync.score=true, with sync.eager=true",
        lambda f: _gathered(f) and f.plan.eager,
        DESIGN,
        "each worker steps its own anchor with its own fresh pseudo-gradient before any "
        "aggregate exists to judge it",
        "set sync.eager=false",
    ),
    Refusal(
        ("sync.score", "sync.inner_time_s"),
        "sync.score=true with sync.inner_time_s",
        # (a robust rule alone combines a budget's rounds unweighted; asynchronous scoring is
        # refused by sync.score alone)
        lambda f: f.plan.score and f.budget and f.plan.mode == "sync",
        DESIGN,
        "scoring holds each worker's change against the others' on one batch, and a slow "
        "worker's honest change, a few steps long, scores like a free rider's: only the "
        "samples it reports of itself, which an untrusted worker could fake, tell them apart",
        "set sync.inner_time_s=null, or sync.score=false (sync.aggregate combines a budget's "
        "rounds unweighted)",
    ),
    Refusal(
        ("sync.aggregate", "sync.score", "sync.mode", "sync.drop_nonfinite"),
        "sync.aggregate other than mean, sync.score=true or sync.mode=async, with "
        "sync.drop_nonfinite=false",
        lambda f: (_gathered(f) or f.plan.mode == "async") and f.drop_nonfinite is False,
        MEANINGLESS,
        "a gathered round, and the asynchronous syncer, which reads each contribution, always "
        "drop a NaN/Inf contribution",
        "set sync.drop_nonfinite=null",
    ),
    Refusal(
        ("sync.score", "sync.warmup_steps", "sync.aggregate"),
        "sync.score=true with sync.aggregate=mean and sync.warmup_steps > 0",
        lambda f: f.plan.score and f.plan.aggregate == "mean" and f.plan.warmup_steps > 0,
        DESIGN,
        "the warmup's gradients are averaged every step and never scored",
        f"set a robust sync.aggregate ({', '.join(a for a in AGGREGATES if a != 'mean')}), "
        "which combines them too",
    ),
    Refusal(
        ("sync.aggregate", "sync.warmup_steps", "trainer.precision"),
        "sync.aggregate other than mean with sync.warmup_steps > 0 and trainer.precision=16-mixed",
        lambda f: _gathered(f) and f.plan.warmup_steps > 0 and f.precision == "16-mixed",
        MEANINGLESS,
        "the robust warmup drops an overflowed (Inf) gradient, which is the loss "
        "scaler's signal to skip the step",
        "use trainer.precision=bf16-mixed or 32-true",
    ),
    Refusal(
        ("sync.excluded_shard", "sync.score", "sync.exclude_after"),
        "sync.excluded_shard=reassign or take_over without sync.score=true and "
        "sync.exclude_after >= 1",
        lambda f: f.moves_shards and not (f.plan.score and f.exclude_after),
        MEANINGLESS,
        "only scoring excludes a worker",
        "set sync.score=true, or sync.excluded_shard=null",
    ),
    # --- fault tolerance -------------------------------------------------------------------------
    Refusal(
        ("ft.backend", "comm.disabled"),
        "ft=torchft with comm.disabled=true",
        lambda f: f.ft and f.comm_disabled,
        MEANINGLESS,
        "nothing is communicated to make fault tolerant",
        "drop ft=torchft",
    ),
    Refusal(
        ("trainer.track_drift", "ft.backend", "sync.mode"),
        "trainer.track_drift=true with ft=torchft and sync.mode=async",
        lambda f: f.ft and f.track_drift is True and f.plan.mode == "async",
        UNAVAILABLE,
        "asynchronous rounds under torchft are sessions with the launcher's syncer: no "
        "collective across the workers to measure the drift with",
        "drop trainer.track_drift (by default it is measured wherever it can be)",
    ),
    Refusal(
        ("trainer.track_drift", "ft.backend", "sync.delay_steps"),
        "trainer.track_drift=true with ft=torchft and sync.delay_steps > 0 or sync.overlap=true",
        lambda f: f.ft and f.track_drift is True and f.plan.delay > 0,
        UNAVAILABLE,
        "a delayed average is merged after its torchft round committed, and no collective "
        "may outlive its round: there is none to measure the drift with",
        "drop trainer.track_drift (by default it is measured wherever it can be)",
    ),
    Refusal(
        ("ft.heartbeat_gate", "sync.mode"),
        "ft.heartbeat_gate=true with sync.mode=async",
        lambda f: f.ft and f.plan.mode == "async" and f.heartbeat_gate is True,
        MEANINGLESS,
        "asynchronous rounds under ft=torchft run no lighthouse to heartbeat to: the syncer "
        "drops a worker whose transfer misses its deadline (ft.grace_s)",
        "drop ft.heartbeat_gate",
    ),
    Refusal(
        ("ft.backend", "sync.warmup_steps", "sync.aggregate"),
        "ft=torchft with sync.warmup_steps > 0 and sync.aggregate other than mean or sync.score",
        lambda f: f.ft and _gathered(f) and f.plan.warmup_steps > 0,
        UNAVAILABLE,
        "the warmup's gradients are torchft's all-reduce, which no rule can judge",
        "set sync.warmup_steps=0",
    ),
    Refusal(
        ("ft.backend", "sync.drop_nonfinite", "sync.comm_dtype"),
        "ft=torchft with sync.drop_nonfinite=true and a 16/32-bit sync.comm_dtype",
        lambda f: (
            f.ft
            and f.drop_nonfinite is True
            and not f.lossy
            and not _gathered(f)
            and f.plan.mode == "sync"  # asynchronous rounds: the syncer's merge drops them
        ),  # fmt: skip
        UNAVAILABLE,
        "torchft's Manager all-reduces the mean, which cannot leave a contribution out",
        "use a low-bit sync.comm_dtype (int8, int4: gathered and checked), "
        "or sync.drop_nonfinite=null",
    ),
    Refusal(
        ("ft.retry_failed_sync", "sync.fragments"),
        "ft.retry_failed_sync=true with Streaming DiLoCo (sync.fragments, delay_steps, merge_alpha,"
        " eager)",
        lambda f: f.ft and f.retry_failed and f.plan.streaming,
        MEANINGLESS,
        "a failed fragment round already keeps each worker's state from before it, and its "
        "fragment syncs again at its next turn",
        "set ft.retry_failed_sync=false",
    ),
    Refusal(
        ("ft.backend", "dist.shard_size"),
        "ft=torchft with dist.shard_size > 1 on one machine",
        lambda f: f.ft and f.shard_size > 1 and not f.torchrun,
        UNAVAILABLE,
        "a sharded replica group is one machine's ranks under torchrun (ft.replica_groups, "
        "ft.replica_id); here each worker is a replica group of one process",
        "run torchrun per machine, or set dist.shard_size=1",
    ),
    Refusal(
        ("ft.backend", "sync.levels"),
        "ft=torchft with sync.levels on one machine",
        lambda f: f.ft and bool(f.plan.levels) and not f.torchrun,
        UNAVAILABLE,
        "an inner level averages inside one machine's replica group under torchrun; here each "
        "worker is a replica group of its own",
        "run torchrun per machine, or drop sync.levels",
    ),
    Refusal(
        ("ft.backend", "sync.aggregate", "sync.score"),
        "ft=torchft, sync.aggregate other than mean or sync.score=true, and replica groups of "
        "several processes (torchrun)",
        lambda f: f.ft and _gathered(f) and f.group_processes > 1,
        UNAVAILABLE,
        "the Manager gathers one contribution per replica group process",
        "run one process per replica group",
    ),
    Refusal(
        ("ft.backend", "sync.inner_time_s"),
        "ft=torchft with sync.inner_time_s and replica groups of several processes (torchrun)",
        lambda f: f.ft and f.budget and f.group_processes > 1,
        UNAVAILABLE,
        "each worker weighs its own samples, and a group would need a weighted round inside it",
        "run one process per replica group, or set sync.inner_time_s=null",
    ),
    Refusal(
        ("ft.backend", "sync.excluded_shard"),
        "ft=torchft with sync.excluded_shard=reassign or take_over",
        lambda f: f.ft and f.moves_shards,
        DESIGN,
        "a worker that heals takes a peer's sampler, and with it the peer's part of the shard",
        "use sync.excluded_shard=skip or null",
    ),
    # --- sharded replica groups ------------------------------------------------------------------
    Refusal(
        ("dist.shard_size", "trainer.nan_policy"),
        "dist.shard_size > 1 with trainer.nan_policy=skip",
        lambda f: f.shard_size > 1 and f.nan_policy == "skip",
        DESIGN,
        "one rank of a replica group would skip a step its group's other ranks take",
        "set trainer.nan_policy=error",
    ),
    Refusal(
        ("dist.shard_size", "sync.excluded_shard"),
        "dist.shard_size > 1 with sync.excluded_shard=reassign or take_over",
        lambda f: f.shard_size > 1 and f.moves_shards,
        DESIGN,
        "an excluded worker is a replica group of ranks, each with a data shard of its own",
        "use sync.excluded_shard=skip or null",
    ),
    # --- virtual workers -------------------------------------------------------------------------
    Refusal(
        ("dist.virtual_workers", "ft.backend"),
        "dist.virtual_workers with ft=torchft",
        lambda f: f.virtual and f.ft,
        MEANINGLESS,
        "torchft's replica groups are processes that may die alone; virtual workers are "
        "threads of one",
        "drop one of them",
    ),
    Refusal(
        ("dist.virtual_workers", "dist.shard_size"),
        "dist.virtual_workers with dist.shard_size > 1",
        lambda f: f.virtual and f.shard_size > 1,
        UNAVAILABLE,
        "FSDP2 shards over a gloo or NCCL group of processes",
        "set dist.shard_size=1",
    ),
    Refusal(
        ("dist.virtual_workers", "sync.inner_time_s", "comm.simulate.worker_speed"),
        "dist.virtual_workers with sync.inner_time_s and no comm.simulate.worker_speed",
        lambda f: f.virtual and f.budget and not f.modelled_clock,
        MEANINGLESS,
        "a budget on the wall clock needs a clock per worker, and virtual workers take turns on "
        "one",
        "model the workers' speeds (comm.simulate.worker_speed, comm.simulate.step_s)",
    ),
    Refusal(
        ("dist.virtual_workers", "comm.simulate.bandwidth_gbps", "comm.simulate.latency_ms"),
        "dist.virtual_workers with comm.simulate.bandwidth_gbps or comm.simulate.latency_ms > 0",
        lambda f: f.virtual and f.link,
        MEANINGLESS,
        "a simulated link sleeps out a collective while the other workers wait their turn",
        "drop comm.simulate.bandwidth_gbps and comm.simulate.latency_ms",
    ),
    # --- budgets and pacing ----------------------------------------------------------------------
    Refusal(
        ("sync.inner_time_s", "sync.merge_alpha", "sync.budget_merge"),
        "sync.inner_time_s with sync.merge_alpha > 0 and sync.budget_merge=normalized (or null)",
        lambda f: (
            f.budget
            and f.plan.mode == "sync"
            and f.plan.merge_alpha != 0
            and f.budget_merge != "weighted"
        ),  # fmt: skip
        MEANINGLESS,
        "a mixed merge leaves part of each worker's own values in its next "
        "contribution, which the normalized merge would scale as if its samples had made it",
        "set sync.merge_alpha=0, or sync.budget_merge=weighted",
    ),
    Refusal(
        ("sync.budget_merge", "sync.inner_time_s", "sync.mode", "sync.aggregate"),
        "sync.budget_merge without sync.inner_time_s or sync.mode=async, or with a robust "
        "sync.aggregate",
        lambda f: (
            f.budget_merge is not None
            and ((not f.budget and f.plan.mode == "sync") or f.plan.aggregate != "mean")
        ),
        MEANINGLESS,
        "it says how a time budget's rounds (or the asynchronous syncer's merges) weigh the "
        "workers' samples: without either, or under a robust rule, which weighs nobody, no "
        "merge would read it",
        "drop sync.budget_merge",
    ),
    Refusal(
        ("sync.inner_time_s", "sync.levels"),
        "sync.inner_time_s with sync.levels under an outer step (Streaming DiLoCo's levels)",
        lambda f: f.budget and bool(f.plan.levels) and f.plan.streaming,
        DESIGN,
        "Streaming DiLoCo's inner levels are plain means of the whole model beside the rounds, "
        "which weigh nobody",
        "use sync.levels without sync.outer (hierarchical rounds, each "
        "weighted), or set sync.inner_time_s=null",
    ),
    Refusal(
        ("sync.inner_time_s", "comm.disabled"),
        "sync.inner_time_s with comm.disabled=true",
        lambda f: f.budget and f.comm_disabled,
        MEANINGLESS,
        "there are no rounds to end",
        "set sync.inner_time_s=null",
    ),
    Refusal(
        ("comm.simulate.step_s", "comm.simulate.worker_speed"),
        "comm.simulate.step_s without comm.simulate.worker_speed",
        lambda f: f.step_s and not f.modelled_clock,
        MEANINGLESS,
        "a step's modelled length needs each worker's speed",
        "set both, or neither",
    ),
    Refusal(
        ("comm.disabled", "sync.warmup_steps"),
        "comm.disabled=true with sync.warmup_steps > 0",
        lambda f: f.comm_disabled and f.plan.warmup_steps > 0,
        MEANINGLESS,
        "nothing syncs, not even the warmup's gradients",
        "set sync.warmup_steps=0",
    ),
    Refusal(
        ("comm.disabled", "sync.outer_state"),
        "comm.disabled=true with sync.outer_state=cpu",
        lambda f: f.comm_disabled and f.outer_state == "cpu",
        MEANINGLESS,
        "nothing syncs: there is no outer state",
        "set sync.outer_state=device",
    ),
    # --- asynchronous rounds (sync.mode=async, docs/asynchronous.md) ----------------------------
    Refusal(
        ("sync.mode", "sync.eager"),
        "sync.mode=async with sync.eager=true",
        lambda f: f.plan.mode == "async" and f.plan.eager,
        MEANINGLESS,
        "an eager worker steps its own anchor with its fresh pseudo-gradient before the round's "
        "mean, and an asynchronous worker already takes the newest global model at once, the "
        "syncer's outer step on what has arrived",
        "drop sync.eager (sync.overlap=true trains on while each exchange is in flight)",
    ),
    Refusal(
        ("sync.mode", "ft.backend", "ft.retry_failed_sync", "ft.min_replicas"),
        "sync.mode=async with ft=torchft and ft.retry_failed_sync=true or ft.min_replicas > 1",
        lambda f: f.plan.mode == "async" and f.ft and (f.retry_failed or f.min_replicas > 1),
        MEANINGLESS,
        "asynchronous rounds run no torchft round to retry and no quorum to hold: the syncer "
        "merges whoever has sent (sync.min_quorum is their quorum)",
        "set ft.retry_failed_sync=false and ft.min_replicas=1 (sync.min_quorum for a quorum of "
        "merges), or sync.mode=sync",
    ),
    Refusal(
        ("sync.mode", "sync.merge_alpha"),
        "sync.mode=async with sync.merge_alpha > 0 and sync.delay_steps=0",
        lambda f: f.plan.mode == "async" and f.plan.merge_alpha != 0 and f.plan.delay == 0,
        DESIGN,
        "an asynchronous exchange that blocks gives the worker the newest global model as its "
        "model and its anchor; a mixed merge is how an answer in flight lands",
        "set sync.delay_steps >= 1 (the answer lands that many steps after the send), or "
        "sync.merge_alpha=0",
    ),
    Refusal(
        ("sync.mode", "sync.score"),
        "sync.mode=async with sync.score=true",
        lambda f: f.plan.mode == "async" and f.plan.score,
        DESIGN,
        "scoring judges every worker's contribution of one round on one batch, and "
        "asynchronous merges hold whichever contributions have arrived",
        "set sync.mode=sync, or sync.score=false (sync.aggregate works asynchronously)",
    ),
    Refusal(
        ("sync.mode", "sync.optimizer_state"),
        "sync.mode=async with sync.optimizer_state=average or desloc",
        lambda f: f.plan.mode == "async" and f.plan.optimizer_state in ("average", "desloc"),
        DESIGN,
        "the optimizer state is averaged in rounds every worker takes part in, and "
        "asynchronous rounds have none between meetings",
        "set sync.optimizer_state=local or reset (each worker drops its state at each "
        "exchange), or sync.mode=sync",
    ),
    Refusal(
        ("sync.mode", "sync.schedule", "sync.inner_time_s"),
        "sync.mode=async with sync.schedule=step or adaptive and sync.inner_time_s",
        lambda f: f.plan.mode == "async" and f.plan.schedule in ("step", "adaptive") and f.budget,
        MEANINGLESS,
        "an asynchronous phase with a time budget ends by sync.inner_time_s, not by a count of "
        "steps: the schedule's periods would change nothing",
        "set sync.schedule=constant, or sync.inner_time_s=null",
    ),
    Refusal(
        ("sync.mode", "sync.schedule", "dist.shard_size", "comm.simulate.worker_speed"),
        "sync.mode=async with sync.schedule=adaptive and dist.shard_size > 1 without "
        "comm.simulate.worker_speed",
        lambda f: (
            f.plan.mode == "async"
            and f.plan.schedule == "adaptive"
            and f.shard_size > 1
            and not f.modelled_clock
        ),
        DESIGN,
        "each shard's syncer decides the period from the merges it makes, and on the wall "
        "clock the shards of one replica group merge apart, so its ranks could adapt apart",
        "set sync.schedule=constant or step, or model the clock (comm.simulate.worker_speed)",
    ),
    Refusal(
        ("sync.staleness_correction", "sync.mode", "sync.outer", "sync.outer_momentum"),
        "sync.staleness_correction=heloco with sync.mode=sync, sync.outer=none or "
        "sync.outer_momentum=0",
        lambda f: (
            f.staleness_correction != "none"
            and (f.plan.mode != "async" or f.plan.outer == "none" or not f.plan.outer_momentum)
        ),
        MEANINGLESS,
        "HeLoCo corrects a stale pseudo-gradient against the syncer's outer momentum: "
        "synchronous rounds have no stale one, and without outer momentum there is nothing "
        "to correct against",
        "set sync.mode=async with sync.outer=diloco (momentum > 0), or "
        "sync.staleness_correction=none",
    ),
    Refusal(
        ("sync.mode", "sync.min_quorum", "sync.grace_s", "sync.outer_delay"),
        "sync.min_quorum > 1, sync.grace_s or sync.outer_delay with sync.mode=sync",
        lambda f: f.plan.mode != "async" and f.syncer_keys,
        MEANINGLESS,
        "they set the asynchronous syncer's merges (its quorum, its grace window, Delayed "
        "Nesterov's N); a synchronous round merges every worker's change through torch's "
        "outer step",
        "set sync.mode=async, or drop them (under ft=torchft the synchronous rounds' quorum "
        "is ft.min_replicas)",
    ),
    Refusal(
        ("sync.max_staleness", "sync.mode"),
        "sync.max_staleness with sync.mode=sync",
        lambda f: f.max_staleness is not None and f.plan.mode != "async",
        MEANINGLESS,
        "a synchronous round merges every worker's change from the same global model: none is "
        "stale",
        "set sync.mode=async, or sync.max_staleness=null",
    ),
    Refusal(
        ("sync.mode", "comm.disabled"),
        "sync.mode=async with comm.disabled=true",
        lambda f: f.plan.mode == "async" and f.comm_disabled,
        MEANINGLESS,
        "nothing is communicated, so there are no rounds to run asynchronously",
        "set sync.mode=sync",
    ),
    Refusal(
        ("sync.mode", "dist.virtual_workers", "comm.simulate.worker_speed"),
        "sync.mode=async with dist.virtual_workers and no comm.simulate.worker_speed",
        lambda f: f.plan.mode == "async" and f.virtual and not f.modelled_clock,
        DESIGN,
        "virtual workers take turns on one thread, so on the wall clock each one's phases "
        "would be timed by the others' turns; the modelled clock gives each its own",
        "set comm.simulate.worker_speed and comm.simulate.step_s, or dist.virtual_workers=null",
    ),
    Refusal(
        (
            "sync.mode",
            "ft.backend",
            "ft.lighthouse",
            "ft.replica_groups",
            "sync.warmup_steps",
        ),
        "sync.mode=async with ft=torchft and ft.lighthouse or ft.replica_groups set, or "
        "sync.warmup_steps > 0",
        lambda f: (
            f.plan.mode == "async"
            and f.ft
            and (f.lighthouse or f.replica_groups or f.warmup_steps > 0)
        ),
        UNAVAILABLE,
        "under ft=torchft the syncer lives in this command's launcher and every worker is a "
        "world of its own: workers started elsewhere cannot reach it, and a synchronous warmup "
        "needs every worker in one collective",
        "leave ft.lighthouse and ft.replica_groups unset, with sync.warmup_steps=0, or set "
        "sync.mode=sync",
    ),
)


def refusal(cfg: Any, get: Callable[[Any, str], Any]) -> Refusal | None:
    """The first row whose condition holds for `cfg`, or None."""
    facts = Facts.of(cfg, get)
    return next((row for row in REFUSALS if row.when(facts)), None)


def check(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """Raise ConfigError with the row's one line when a row holds."""
    row = refusal(cfg, get)
    if row is not None:
        raise ConfigError(row.line())


def markdown() -> str:
    """The table docs/configuration.md shows."""
    out = ["| condition | why (kind) | instead |", "|---|---|---|"]
    for row in REFUSALS:
        cell = f"{row.why} ({row.kind})"
        out.append(f"| `{row.condition}` | {cell} | {row.fix} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

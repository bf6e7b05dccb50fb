"""One reading of the `sync` config: what the strategy does, derived once.

Every part that needs to know what a sync config means asks a `SyncPlan`, never the raw keys:
the averager factory (`localsgd.loop.strategies`), the config checks (`localsgd.cli.checks`),
the fault-tolerance checks (`localsgd.cli.fault_tolerance`), the resume path and the reshard
refusal (`localsgd.cli.preflight`, `localsgd.loop.checkpoint.reshard`). A question answered
twice from the raw keys is how a config that passed every check crashed at run time (the
streaming period was read as `sync.period` in one place and as the widest level's in another).

The plan reads a node that answers `sync.KEY` either way: a dataclass (`SyncConfig`), a Hydra
DictConfig or a plain dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localsgd.averaging.rounds import OUTER_DEFAULTS

# sync key: why its per-worker state cannot move to another world size (`SyncPlan.reshard_refusal`)
RESHARD_REFUSED = {
    "sync.overlap": "an average is in flight at every sync",
    "sync.delay_steps": "a fragment's average is in flight",
    "sync.eager": "each worker's pseudo-gradient is carried to the next round",
    # (asynchronous fragments meet whole at checkpoints: only their sharded syncers' per-fragment
    # outer states stay laid out for the old shards)
    "sync.fragments": "fragments sync at different steps, or under asynchronous rounds keep a "
    "sharded outer state per fragment",
    "sync.aggregate": "the verdicts (bad-round streaks, exclusions) name the old world's ranks",
    "sync.score": "the verdicts (bad-round streaks, exclusions) name the old world's ranks",
}


def _read(node: Any, key: str) -> Any:
    return node[key] if isinstance(node, dict) else getattr(node, key)


def _read_or(node: Any, key: str, default: Any) -> Any:
    """A key added after checkpoints were written (their saved config lacks it): its default."""
    try:
        return _read(node, key)
    except (KeyError, AttributeError):
        return default


@dataclass(frozen=True)
class SyncPlan:
    """What a `sync` config runs. Build it with `SyncPlan.of(cfg.sync)`."""

    outer: str  # none | diloco | slowmo
    levels: tuple[tuple[Any, int], ...]  # (group_size as written, period), narrowest first
    period: int  # the widest level's period: the (streamed) outer step's H
    fragments: int  # P
    delay: int  # τ (sync.overlap: 1)
    merge_rule: str  # mix | progress (sync.overlap: progress)
    merge_alpha: float
    eager: bool
    overlap: bool
    error_feedback: bool
    outer_lr: float | None  # resolved to the method's default where the config says null
    outer_momentum: float | None
    outer_nesterov: bool | None
    warmup_steps: int
    optimizer_state: str  # local | average | reset | desloc
    moment_periods: tuple[int, ...]  # desloc's (first, second) periods, in parameter averages
    schedule: str  # constant | step | adaptive
    aggregate: str  # mean | clip | trimmed_mean | median
    drop_nonfinite: bool  # resolved: null means true
    score: bool
    compress: str  # none | topk
    topk_density: float
    topk_chunk: int
    topk_mean: str  # all | senders
    mode: str = "sync"  # sync | async (asynchronous outer rounds)

    @classmethod
    def of(cls, sync: Any) -> SyncPlan:
        levels = tuple(
            (_read(lv, "group_size"), _read(lv, "period")) for lv in (_read(sync, "levels") or ())
        )
        overlap = bool(_read(sync, "overlap"))
        outer = _read(sync, "outer")
        defaults = OUTER_DEFAULTS.get(outer, {})

        def resolved(key: str, name: str) -> Any:
            value = _read(sync, key)
            return defaults.get(name) if value is None else value

        # the default follows the momentum: with none, Nesterov's step is plain SGD's (torch
        # refuses the flag there); set explicitly with no momentum, it is refused
        nesterov = resolved("outer_nesterov", "nesterov")
        if _read(sync, "outer_nesterov") is None and not resolved("outer_momentum", "momentum"):
            nesterov = False
        return cls(
            outer=outer,
            levels=levels,
            period=levels[-1][1] if levels else _read(sync, "period"),
            fragments=_read(sync, "fragments"),
            # sync.overlap is shorthand for delay_steps=1, merge_rule=progress
            delay=1 if overlap else _read(sync, "delay_steps"),
            merge_rule="progress" if overlap else _read(sync, "merge_rule"),
            merge_alpha=float(_read(sync, "merge_alpha")),
            eager=bool(_read(sync, "eager")),
            overlap=overlap,
            # null: on where top-k needs it, off for every other wire
            error_feedback=bool(_read(sync, "error_feedback"))
            if _read(sync, "error_feedback") is not None
            else _read_or(sync, "compress", "none") == "topk",
            outer_lr=resolved("outer_lr", "lr"),
            outer_momentum=resolved("outer_momentum", "momentum"),
            outer_nesterov=nesterov,
            warmup_steps=int(_read(sync, "warmup_steps")),
            optimizer_state=_read(sync, "optimizer_state"),
            moment_periods=tuple(_read_or(sync, "moment_periods", [3, 6])),
            schedule=_read(sync, "schedule"),
            aggregate=_read(sync, "aggregate"),
            # null: true, whatever the aggregate (false: today's unguarded all-reduce)
            drop_nonfinite=_read(sync, "drop_nonfinite") is None
            or bool(_read(sync, "drop_nonfinite")),
            score=bool(_read(sync, "score")),
            compress=_read_or(sync, "compress", "none"),
            topk_density=float(_read_or(sync, "topk_density", 1 / 64)),
            topk_chunk=int(_read_or(sync, "topk_chunk", 4096)),
            topk_mean=_read_or(sync, "topk_mean", "all"),
            mode=_read_or(sync, "mode", "sync"),
        )

    def comm_format(self, comm_dtype: str) -> Any:
        """What an average sends: `sync.comm_dtype` (a name), or a `TopKCodec` with
        `sync.compress=topk`."""
        if self.compress == "topk":
            from localsgd.averaging.wire.sparse import TopKCodec

            return TopKCodec(self.topk_density, self.topk_chunk, self.topk_mean)
        return comm_dtype

    def gathered_wire(self, comm_dtype: str) -> bool:
        """Whether the averages go on the wire as messages every rank gathers and decodes
        (int8/int4, top-k), so that each rank can check them all (NaN/Inf left out), under
        torchft too; False: all-reduced in 16 or 32 bits."""
        return self.compress != "none" or comm_dtype not in ("float32", "bfloat16", "float16")

    @property
    def gathered(self) -> bool:
        """Whether each sync all-gathers every worker's contribution (`localsgd.averaging.
        trust`): a robust aggregate or scoring. False: the mean all-reduced, today's path and
        bits (a NaN/Inf contribution dropped in band: `localsgd.averaging.finite`)."""
        return self.aggregate != "mean" or self.score

    @property
    def period_key(self) -> str:
        """The key the streaming period is read from, for error lines."""
        return f"sync.levels[{len(self.levels) - 1}].period" if self.levels else "sync.period"

    @property
    def streaming(self) -> bool:
        """Streaming DiLoCo's mechanisms (`StreamingAverager`): fragments, a delayed or mixed
        merge (`sync.overlap` is its one-step progress-keeping case), the eager outer step, or an
        outer step over hierarchical levels (the widest level's, streamed)."""
        return (
            self.fragments != 1
            or self.delay != 0
            or self.merge_alpha != 0
            or self.eager
            or self.merge_rule != "mix"
            or bool(self.levels and self.outer != "none")
        )

    @property
    def spacing(self) -> int:
        """H/P: the steps between two fragments' syncs (the whole period when P = 1)."""
        return self.period // max(self.fragments, 1)

    @property
    def in_sync_after_sync(self) -> bool:
        """Whether every worker holds the same model right after a sync over every worker (a
        delayed one included: its merge replaces the model): not with fragments (the others
        keep local progress), a mixed or progress-keeping merge, or eager steps (per-worker
        anchors)."""
        return (
            self.fragments == 1
            and self.merge_alpha == 0
            and not self.eager
            and self.merge_rule == "mix"
        )

    @property
    def global_state_between_syncs(self) -> bool:
        """Whether every worker holds the same global model between syncs when they are never
        all in sync (Streaming DiLoCo's anchors, with an outer step that is not eager): a
        shared checkpoint to resume from (`Averager.global_state`)."""
        return self.streaming and self.outer != "none" and not self.eager

    def reshard_refusal(self, sharded: bool = False) -> str | None:
        """Why a checkpoint of this run cannot continue at another world size, or None.
        `sharded`: the checkpoint or the run has sharded replica groups."""
        # asynchronous fragments checkpoint at meetings, where every fragment just synced
        fragments = self.fragments != 1 and (self.mode != "async" or sharded)
        values = {
            # asynchronous rounds checkpoint at meetings, where nothing is in flight
            "sync.overlap": self.overlap and self.mode != "async",
            "sync.delay_steps": 0 if self.overlap else self.delay,
            "sync.eager": self.eager,
            "sync.fragments": self.fragments if fragments else 0,
            "sync.aggregate": self.aggregate if self.aggregate != "mean" else 0,
            "sync.score": self.score,  # under the mean, scoring alone gathers and judges
        }
        for key, why in RESHARD_REFUSED.items():
            if values[key]:
                return f"{key}={values[key]!r} ({why})"
        return None


def strategy_name(sync: Any) -> str:
    """The averaging strategy the `sync` config runs, named as its conf/sync/ preset (read from
    what the config does, so `sync.outer=diloco` on the command line is labelled diloco too;
    wandb's `job_type`). The most specific feature wins: an outer step over levels, levels,
    streaming, an outer optimizer (over top-k pseudo-gradients: sparseloco), overlap, an
    adaptive period, a synchronous warmup, then k=1 or plain local SGD."""
    plan = SyncPlan.of(sync)
    if plan.levels:
        return "hierarchical" if plan.outer == "none" else f"hierarchical_{plan.outer}"
    if plan.streaming and plan.outer != "none":
        return f"streaming_{plan.outer}"
    if plan.outer != "none":  # top-k pseudo-gradients under an outer step: SparseLoCo's shape
        return "sparseloco" if plan.compress == "topk" else plan.outer
    if plan.overlap:
        return "overlap"
    if plan.streaming:
        return "streaming_average"
    if _read(sync, "schedule") == "adaptive":
        return "adaptive"
    if _read(sync, "warmup_steps") > 0:
        return "post_local_sgd"
    return "sync_sgd" if _read(sync, "period") == 1 else "local_sgd"

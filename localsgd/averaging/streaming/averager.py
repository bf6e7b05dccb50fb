"""Streaming DiLoCo (Douillard et al. 2025) and eager outer steps (Kale et al. 2025).

**Fragments.** The averaged tensors are split into `fragments=P` fragments, strided by block:
the *blocks* are the children holding floating-point tensors of the `nn.ModuleList` or
`nn.Sequential` with the most such children anywhere in the module (ties: the outermost, i.e.
the first in `module.modules()` order), else the module's own such children; `blocks=` names
them explicitly. Fragment p takes blocks p, p+P, p+2P, ... (a tensor shared by blocks goes with
the first). Each tensor outside every block (embeddings, final norm, head), in the order of
`averaged_tensors`, goes to the fragment with the fewest elements so far (ties: the lowest
index). P=1 needs no blocks. In the flat buffers each fragment is one contiguous region per
buffer (its parameters, then its floating-point buffers), so a sync sends that region only.

**Schedule** (H = `period`, H % P == 0, τ = `delay_steps` <= H/P). Fragment p is *launched*
after step s (from 0, torch's counter) when `s >= warmup_steps and (s - warmup_steps) % H ==
p*H/P`, and *merged* after step s + τ. P=1, τ=0 is `OuterAverager`'s rule. With τ=0 the
all-reduce blocks; with τ>0 it runs asynchronously while τ steps train (a simulated link's time
is waited out at the merge, only for what is left). τ <= H/P: at most one fragment in flight
between steps (at τ = H/P a merge precedes the next launch within the step). Launched fp32
exchanges go out in buckets of `bucket_mb` MiB (None: one all-reduce per piece).

    steps:       0 1 2 3 4 5 6 7 8 9 ...     H=8, P=4, warmup=0, τ=1: L launch, M merge
    fragment 0:  L M . . . . . . L M          (blocks 0, 4, 8, ...)
    fragment 1:  . . L M . . . . . . L M      (blocks 1, 5, 9, ...)
    fragment 2:  . . . . L M . . . . . .
    fragment 3:  . . . . . . L M . . . .

**What is merged** (per fragment, its own anchor and outer `torch.optim.SGD`, DiLoCo's lr 0.7,
momentum 0.9, Nesterov): at the launch the pseudo-gradient `anchor - local` goes on the wire; at
the merge its mean updates the anchor by the outer step (parameters; floating-point buffers take
the mean plainly; the fragment's first sync after a warmup is a plain average, as in
`OuterAverager`), and the local values become `α·local + (1-α)·anchor` with α = `merge_alpha`
and `local` the values at the merge (α=0: DiLoCo's replacement): `merge_rule="mix"`. With
`merge_rule="progress"` (τ >= 1, α = 0) a merge keeps this rank's progress since the launch
instead: `local <- global + (local - local at the launch)`, the delayed averaging of DaSGD.
`outer=False` is plain averaging by fragment: the global value is the mean of the values launched
(below fp32 or under a robust rule, the anchor plus the combined change since the fragment's
last sync).
P=1, τ=1, `outer=False`, "progress" is `PeriodicAverager(overlap=True)` bit for bit (the same
launched round and progress merge): the trainer's `sync.overlap=true` is that configuration of
this averager.

**Eager** (`eager=True`, Kale et al. 2025, "eager updates"): the whole outer step overlaps the
next H steps. At fragment p's round t each worker m computes its fresh pseudo-gradient
`d_t = anchor_m - local`, launches its mean, receives the mean `D_{t-1}` launched at round
t-1 (zeros at the first round), and steps its outer optimizer at once with
`d_t/M + D_{t-1} - d_{t-1}/M`: its own fresh contribution plus the others' one-round-delayed
ones (M = world size). Anchors and outer states are then per worker; what every rank receives,
`D_{t-1}`, is identical. The first round after a warmup is a blocking plain average.

**Inner levels** (`inner_levels={period: group_size}`, narrowest first, as
`HierarchicalAverager`'s levels without the widest): each averages the whole model plainly, in
fp32, within groups of contiguous ranks, after step s when `s >= warmup_steps` and its period
divides s (the last listed such level: torch's hierarchical rule among the inner levels; the
widest level, every rank, is the streaming schedule above with H = `period`). An inner average
is not skipped on a launch or merge step (a fragment is only part of the model). On one step
the order is: the inner average, then the merge of the fragment in flight, then the launch. So
a launch sends what the group agreed on, and a merge acts last on the local values (α=0 leaves
the merged fragment equal to the global value on every rank). Anchors, outer states and values
in flight are never touched by an inner average.

Replicas share bit for bit, after each merge, what `common_tensors()` returns: every anchor (not
eager), the merged fragment's values when α=0 under "mix", or the mean received (plain, eager).

**Below fp32** (`comm_dtype`: the pseudo-gradient is what is rounded, or in plain streaming each
fragment's change since its last sync). Every fragment goes on the wire through its own wire
stage (`rounds.wire.Wire`), one message per piece (the fragment's region of one flat buffer).
bfloat16/float16: the piece is cast to a 16-bit copy and all-reduced, as for the whole model.
int8/float8_e4m3fn/int4/float4_e2m1 (`localsgd.averaging.wire.quantize`,
one fp32 scale per `quant_block_size` values, blocks starting at the piece's start): each rank
encodes its piece, the messages are all-gathered (asynchronously when τ>0 and for eager rounds),
and every rank decodes them all and averages in fp32 in rank order, so all ranks get the same
bits, blocking or launched. A sync counts what this rank sends: payload plus scales (4 bits at
the default block: 0.133x fp32). `error_feedback` keeps one residual per piece (what this rank
wanted to send minus what its message decodes to), adds it to that fragment's next
contribution before encoding, and checkpoints it. The final blocking `average()` of plain or
eager runs sends the whole model in fp32.

Memory beyond the model: the anchors and outer momentum; for launched, mixed (α > 0) or eager
rounds one fragment-sized work buffer per fragment (all fragments together: one model; a
blocking round that replaces runs in place in the flat buffers), one more under "progress",
three more with `eager`; below fp32, per piece the wire's buffers (`QuantizedWire`: about two
fp32 copies of the piece for float4_e2m1 and the gathered messages) or a 16-bit copy, and a
residual with `error_feedback`. `outer_state="cpu"` moves the anchors and outer momentum to host
memory, with a host staging copy per fragment (`localsgd.averaging.offload`; the same bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging.averager import Averager, mirrored
from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.hierarchical import inner_level_groups, level_by_period
from localsgd.averaging.offload import check_outer_state
from localsgd.averaging.rounds import DILOCO, Rounds
from localsgd.averaging.rounds.merge import MERGE_RULES
from localsgd.averaging.schedule import ConstantPeriod, cycle_length
from localsgd.averaging.streaming.fragments import FragmentOrder, Tensors
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.averaging.wire.compress import CommFormat, comm_dtype_of
from localsgd.averaging.wire.quantize import DEFAULT_BLOCK_SIZE

__all__ = ["MERGE_RULES", "StreamingAverager"]


class StreamingAverager(FragmentOrder, Averager):
    """Streaming DiLoCo: `fragments` fragments synced in turn, each `delay_steps` late, merged
    with `merge_alpha`; `eager` overlaps the whole outer step; `outer=False` streams plain
    averages; `inner_levels` adds hierarchical levels below the streaming one; `outer_state="cpu"`
    keeps the anchors and outer momentum in host memory (`offload`); `aggregate`/`judge` gather
    each fragment's contributions and combine them robustly (`rounds.combine.Gathered`), blocking
    or launched. Called once after every optimizer step, like every averager here. See the
    module docstring for the split, the schedule, the levels and the arithmetic; P=1, τ=0, α=0
    is `OuterAverager` bit for bit. `module` is required (the blocks come from it). Every rank
    must construct it in the same order relative to other group creations when `inner_levels`
    make subgroups."""

    failed_round_restores = "round"

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: nn.Module,
        fragments: int = 1,
        delay_steps: int = 0,
        merge_alpha: float = 0.0,
        eager: bool = False,
        outer: bool = True,
        outer_lr: float = DILOCO["lr"],
        outer_momentum: float = DILOCO["momentum"],
        outer_nesterov: bool = DILOCO["nesterov"],
        outer_warmup_rounds: int = 0,
        blocks: Sequence[nn.Module] | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
        init_sync: bool | None = None,
        comm_dtype: str | CommFormat = torch.float32,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        error_feedback: bool = False,
        inner_levels: dict[int, int] | None = None,
        merge_rule: str = "mix",
        bucket_mb: float | None = None,
        mirror: bool | None = None,
        outer_state: str = "device",
        error_feedback_decay: float = 1.0,
        drop_nonfinite: bool = True,
        aggregate: Aggregate | None = None,
        judge: Judge | None = None,
        schedule: ConstantPeriod | None = None,
        round_starts: bool = False,
    ):
        if period < 1 or warmup_steps < 0 or fragments < 1:
            raise ValueError("period and fragments must be >= 1, warmup_steps >= 0")
        if period % fragments:
            raise ValueError(f"period={period} must be a multiple of fragments={fragments}")
        if not 0 <= delay_steps <= period // fragments:
            raise ValueError(f"delay_steps must be in [0, period/fragments], got {delay_steps}")
        if not 0 <= merge_alpha < 1:
            raise ValueError(f"merge_alpha must be in [0, 1), got {merge_alpha!r}")
        if merge_rule not in MERGE_RULES:
            raise ValueError(f"merge_rule must be one of {MERGE_RULES}, got {merge_rule!r}")
        progress = merge_rule == "progress"
        if progress and (merge_alpha or not delay_steps):
            raise ValueError("merge_rule='progress' needs delay_steps >= 1 and merge_alpha=0")
        if bucket_mb is not None and bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        if eager and (delay_steps or not outer):
            raise ValueError(
                "eager overlaps the whole outer step: it needs outer and delay_steps=0"
            )
        if aggregate is None and judge is not None:
            raise ValueError("judge needs an aggregate (Aggregate('mean') for the gathered mean)")
        if aggregate is not None and eager:
            raise ValueError(
                "a robust aggregate needs eager=False: each worker steps its own anchor with "
                "its own fresh pseudo-gradient before any aggregate exists"
            )
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        host = check_outer_state(outer_state)
        if host and not outer:
            raise ValueError("outer_state='cpu' needs outer=True (plain streaming keeps no state)")
        self.outer_state = outer_state
        if error_feedback and dtype == torch.float32:
            raise ValueError("error_feedback needs a comm_dtype below float32 (nothing is rounded)")
        if outer_warmup_rounds < 0:
            raise ValueError(f"outer_warmup_rounds must be >= 0, got {outer_warmup_rounds}")
        self.comm_dtype = dtype  # what goes on the wire
        self.period, self.fragments = period, fragments
        self.alpha, self.eager, self.outer = float(merge_alpha), eager, outer
        self.progress = progress
        self.offset = period // fragments
        schedule = schedule if schedule is not None else ConstantPeriod(period)
        self.delay_steps = delay_steps
        # a varying period changes between cycles of the P fragments: the cycle's start and H
        self.cycle_start, self.cycle_period = warmup_steps, 0
        self.cycle_period = self._cycle_period(schedule, warmup_steps)
        # the tensors bound in fragment order: each fragment contiguous in every buffer
        self._order_fragments(module, fragments, blocks)
        sgd = {"lr": outer_lr, "momentum": outer_momentum, "nesterov": outer_nesterov,
               "warmup_rounds": outer_warmup_rounds}  # fmt: skip
        # plain streaming sends the values in fp32; below it (or judged) the change since the
        # fragment's last sync, which a lossy wire can round and a robust rule judge
        lossy = dtype != torch.float32 or aggregate is not None
        kind = "pseudo_gradient" if outer else ("change" if lossy else "values")
        comm = Communicator(process_group, stats, link, guard=drop_nonfinite)

        def make_rounds(flat: FlatBuffers) -> Rounds:
            return Rounds(
                flat,
                self.fragment_parts(flat),
                size=comm.size,  # M, the workers of the widest level
                contribution=kind,
                outer=sgd if outer else None,
                host=host,
                fmt=dtype,
                error_feedback=error_feedback,
                feedback_decay=error_feedback_decay,
                aggregate=aggregate,
                judge=judge,
                alpha=merge_alpha,
                progress=progress,
                launched=delay_steps > 0,
                eager=eager,
                bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20),
                anchored=round_starts,  # plain streaming's normalized weighted rounds scale
            )

        inner = dict(inner_levels or {})
        self.inner_periods = list(inner)
        super().__init__(
            [*inner_level_groups(comm, inner), comm],
            process_group,
            module=module,
            rounds=make_rounds,
            warmup_steps=warmup_steps,
            init_sync=init_sync,
            mirror=mirror,
            delay=delay_steps,
            parts=fragments,
            schedule=schedule,
        )

    # --- the schedule --------------------------------------------------------------------------

    def launching(self, step: int) -> int | None:
        """The fragment launched after step `step`, or None. With a varying period (a schedule:
        step or adaptive) the fragments sync every H/P steps of their cycle, whose H the
        schedule set when the cycle began; the next cycle begins H steps after this one (its
        first fragment is known, the others once its H is)."""
        if step < self.warmup_steps:
            return None
        if not self.schedule.varies:
            r = (step - self.warmup_steps) % self.period
            return None if r % self.offset else r // self.offset
        start, period = self.cycle_start, self.cycle_period
        if step >= start + period:
            return 0 if step == start + period else None
        r, offset = step - start, period // self.fragments
        return None if r % offset else r // offset

    def _cycle_period(self, schedule: ConstantPeriod, step: int) -> int:
        """A cycle's H: the schedule's period at its start, rounded up to a multiple of P that
        leaves each fragment at least τ steps (H/P >= max(τ, 1))."""
        p = self.fragments
        return cycle_length(schedule, step, p, least=p * max(self.delay_steps, 1))

    def maybe_average(self) -> bool:
        step = self.step
        if self.schedule.varies and step == self.cycle_start + self.cycle_period:
            # a new cycle: the period the schedule decided at the last one's end
            self.cycle_start, self.cycle_period = step, self._cycle_period(self.schedule, step)
        return super().maybe_average()

    def merging(self, step: int) -> int | None:
        """The fragment merged (eager: stepped) after step `step`, or None."""
        return self.launching(step - self.delay)

    def round_at(self, step: int) -> tuple[int, int] | None:
        p = self.launching(step)
        return None if p is None else (p, self.widest)

    def inner_level_at(self, step: int) -> int | None:
        """The inner level that averages the whole model after step `step`, or None."""
        return level_by_period(step, self.warmup_steps, self.inner_periods)

    def is_plain(self, p: int, step: int) -> bool:
        # fragment p's first sync after a warmup is a plain average
        first = self.cycle_period // self.fragments
        return self.warmup_steps > 0 and step == self.warmup_steps + p * first

    def acts_at(self, step: int) -> bool:
        merges = self.delay and self.merging(step) is not None
        return bool(merges) or self.level_at(step) is not None

    @property
    def widest(self) -> int:
        return len(self.levels) - 1

    def period_of(self, level: int) -> int:
        if level != self.widest:
            return self.inner_periods[level]
        return self.cycle_period if self.schedule.varies else self.period

    def rule_state(self) -> dict:
        cycle = {"cycle_start": self.cycle_start, "cycle_period": self.cycle_period}
        return {**super().rule_state(), **cycle}

    def load_rule_state(self, state: dict) -> None:
        super().load_rule_state(state)
        if "cycle_start" in state:
            self.cycle_start = int(state["cycle_start"])
            self.cycle_period = int(state["cycle_period"])

    def next_sync(self, step: int) -> int | None:
        s = max(step, self.warmup_steps + self.delay)
        while self.merging(s) is None:
            s += 1
        return s

    @property
    def rounds_overlap(self) -> bool:
        """Whether one step both merges a fragment and launches the next (τ = H/P): two rounds
        in one step, which a round driver (torchft's) cannot run."""
        return 0 < self.delay == self.offset

    def sync_at(self, step: int) -> str | None:
        """A fragment's sync: "sync" (τ = 0, blocking), or "launch" and, τ steps later,
        "merge" (one step never does both below τ = H/P, which a round driver requires)."""
        if not self.delay:
            return "sync" if self.launching(step) is not None else None
        if self.merging(step) is not None:
            return "merge"
        return "launch" if self.launching(step) is not None else None

    # --- the rounds ----------------------------------------------------------------------------

    def _weigh(self, p: int, comm: Communicator, launched: bool, level: int) -> float | None:
        if self.inner_periods or (self.normalized and self.alpha):
            raise ValueError(
                "weighted rounds need no inner_levels (their plain means weigh nobody), and "
                "normalized ones merge_alpha=0 (a mixed merge leaves part of each worker's own "
                "values in its next contribution, which its samples did not make): set "
                "weighted=False"
            )
        return super()._weigh(p, comm, launched, level)

    def _finish(self, q: int) -> None:
        super()._finish(q)
        if not self.outer and self.launching(self.step) == q:  # the launch reuses q's wire
            self.received_mean = [t.clone() for t in self.rounds.sent[q]]

    @mirrored()
    def average(self) -> None:
        """Blocking, outside the schedule (e.g. before the final evaluation): a fragment in
        flight is merged first; then every fragment takes one blocking outer step (plain if
        it has not synced since the warmup; `OuterAverager.average` for P=1), or, plain or
        eager, every rank takes the plain mean of the whole model (eager: the rounds in flight
        are waited for and dropped; the mean of the workers holds their contributions)."""
        rounds = self.rounds
        self.ensure_bound()
        buffers, before = self.flat.buffers, self.stats.bytes
        for p in range(self.fragments):
            if self.eager:
                rounds.drop(p)
            elif rounds.holding[p]:
                rounds.finish(p, buffers, self.comm, self.step)
                if self.weighted:
                    self.part_samples.merged(self.widest, p)
        # a blocking round per fragment (weighted, plain streaming too); eager anchors are each
        # worker's own: the plain mean of the whole model brings them together
        if (self.outer or self.weighted) and not self.eager:
            for p in range(self.fragments):
                plain = self.warmup_steps > 0 and self.step <= self.warmup_steps + p * self.offset
                plain = plain and self.outer
                scale = self._weigh(p, self.comm, False, self.widest) if self.weighted else None
                try:
                    rounds.blocking(p, buffers, self.comm, 0, self.step, plain, scale, alpha=0.0)
                finally:
                    self.comm.unweigh()
        else:
            for flat in buffers:
                self.comm.mean_(flat)
            rounds.reset(buffers)
        self._run_hooks(self.comm, self.widest, None)
        self._count(self.widest, before)
        self.all_in_sync = True

    def global_state(self) -> Tensors | None:
        """The anchors, with an outer step (eager ones are per worker): the global model as of
        each fragment's last sync, identical on every rank."""
        return list(self.rounds.anchors.first) if self.outer and not self.eager else None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fragments": self.fragments}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("fragments", self.fragments)) != self.fragments:
            raise ValueError(
                f"the checkpoint has fragments={state['fragments']}, this run {self.fragments}"
            )
        super().load_state_dict(state)

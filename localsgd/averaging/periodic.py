"""Periodic model averaging, the local-SGD primitive, with torch's signature and step semantics."""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.averager import Averager, RoundsFactory
from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.rounds import Rounds, whole
from localsgd.averaging.schedule import ConstantPeriod
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.averaging.wire.compress import comm_dtype_of
from localsgd.averaging.wire.quantize import DEFAULT_BLOCK_SIZE


class PeriodicAverager(Averager):
    """Averages parameters every `period` steps after `warmup_steps`: a drop-in for torch's
    `PeriodicModelAverager(period, warmup_steps, process_group)`.

    Call `average_parameters(params)` (torch's way, e.g. inside torch's `PostLocalSGDOptimizer`)
    or `maybe_average()` once after every `optimizer.step()`. It averages after step `s` (the
    integer `step`, from 0) when `s >= warmup_steps and (s - warmup_steps) % period == 0`,
    exactly as torch does. Unlike torch, the tensors become views of persistent flat buffers, so
    an average is one in-place all-reduce per buffer and allocates nothing; and every parameter
    given is averaged, where torch skips those whose `.grad` is None.

    `module=` averages the module's parameters and floating-point buffers (BatchNorm
    statistics), bound at construction. `schedule` (see `localsgd.averaging.schedule`) replaces
    the fixed period: then it averages when `s >= warmup_steps` and at least
    `schedule.period_at(s)` steps have passed since its last average. `comm_dtype` (bfloat16 /
    float16, or block-quantised int8 / float8_e4m3fn / int4 / float4_e2m1 with
    `quant_block_size` values per scale) communicates the change since the last sync in low
    precision (`localsgd.averaging.wire.compress`); `error_feedback` carries each worker's rounding
    residual into its next sync. `overlap=True`
    launches each average asynchronously in `bucket_mb` buckets and applies it one step later
    with the progress merge (`Rounds(launched=True, progress=True)`; the same bits as
    `StreamingAverager(delay_steps=1, merge_rule="progress", outer=False)`, the general form the
    trainer runs). `link` simulates a slow network for every collective.

    Sharded parameters (DTensors, e.g. FSDP2's) are averaged through copies of their local
    shards (`mirror`; None: exactly when there are DTensors; see `localsgd.averaging.averager`).

    `aggregate` (a `localsgd.averaging.trust.robust.Aggregate`) gathers every worker's change since
    the last sync and combines them robustly, dropping non-finite ones; `judge` scores and
    excludes workers (`localsgd.averaging.trust.trusted_round`). None: the plain all-reduced mean.

    `round_starts=True` keeps, with the plain fp32 mean, the state after each average (the
    rounds' anchors, `Rounds(anchored=True)`: one more copy of the buffers), which normalized
    weighted rounds need (`Averager.normalized`); the rounds that send a change or a
    pseudo-gradient hold it already.

    `rounds`: a factory of the `Rounds` to run, a function of the bound `FlatBuffers`, instead of
    the one the keywords above build (docs/averaging-api.md, "Building blocks").

    `init_sync=True` gives every rank rank 0's tensors when they are bound, as DDP does when
    built; None (the default) does so only where replicas that start apart would never meet:
    rounds that keep an anchor (`Rounds.anchored`: low-precision or robust changes, an outer
    optimizer). torch's averager does not, and a plain average brings differing replicas
    together at its first sync anyway.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: torch.nn.Module | None = None,
        stats: CommStats | None = None,
        schedule: ConstantPeriod | None = None,
        comm_dtype: str | torch.dtype = torch.float32,
        link: SimulatedLink | None = None,
        overlap: bool = False,
        bucket_mb: float = 25.0,
        rounds: RoundsFactory | None = None,
        init_sync: bool | None = None,
        error_feedback: bool = False,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        mirror: bool | None = None,
        aggregate: Aggregate | None = None,
        judge: Judge | None = None,
        error_feedback_decay: float = 1.0,
        drop_nonfinite: bool = True,
        round_starts: bool = False,
    ):
        if period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        schedule = schedule if schedule is not None else ConstantPeriod(period)
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        if aggregate is None and judge is not None:
            raise ValueError("judge needs an aggregate (Aggregate('mean') for the gathered mean)")
        comm = Communicator(process_group, stats, link, guard=drop_nonfinite)
        # the change since the last sync is what a lossy wire rounds and a robust rule judges;
        # in fp32 the values themselves are averaged (torch's averager, bit for bit)
        lossy = dtype != torch.float32 or aggregate is not None
        kind = "change" if lossy else "values"
        bucket = int(bucket_mb * 2**20)

        def default_rounds(flat: FlatBuffers) -> Rounds:
            return Rounds(
                flat,
                [whole(flat)],
                size=comm.size,
                contribution=kind,
                fmt=dtype,
                error_feedback=error_feedback,
                feedback_decay=error_feedback_decay,
                aggregate=aggregate,
                judge=judge,
                launched=overlap,
                progress=overlap,
                anchored=round_starts,
                bucket_bytes=bucket,
            )

        self.comm_dtype = dtype
        super().__init__(
            [comm],
            process_group,
            module=module,
            rounds=rounds if rounds is not None else default_rounds,
            warmup_steps=warmup_steps,
            init_sync=init_sync,
            mirror=mirror,
            delay=1 if overlap else 0,
            schedule=schedule,
            loss_rides=not overlap,  # its loss rides in the buffers, as it always has
        )

    @property
    def rounds_overlap(self) -> bool:
        """With overlap at period 1 every step merges one average and launches the next."""
        return self.delay > 0 and self.schedule.period_at(self.step) <= self.delay

    @property
    def period(self) -> int:
        return self.schedule.period_at(self.step)

    def period_of(self, level: int) -> int:
        return self.period

    def due(self, step: int) -> bool:
        """Whether the rule averages after step `step`."""
        if step < self.warmup_steps or not self.schedule.averages:
            return False
        if self.schedule.varies:
            return step - self.last_average >= self.schedule.period_at(step)
        # torch's rule, which holds even where `step` was set from outside (a reload)
        return (step - self.warmup_steps) % self.schedule.period == 0

    def round_at(self, step: int) -> tuple[int, int] | None:
        return (0, 0) if self.due(step) else None

    def next_sync(self, step: int) -> int | None:
        if self.rounds.pending and step == self.step:
            return step  # this step waits for the average in flight
        if not self.schedule.averages:
            return None
        s = max(step, self.warmup_steps)
        while not self.due(s):
            s += 1
        # with overlap the ranks wait for each other only where the average is merged
        return s + 1 if self.delay else s

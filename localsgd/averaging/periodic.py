"""Periodic model averaging, the local-SGD primitive, with torch's signature and step semantics."""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.averager import Averager, ReducerFactory
from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.compress import LowPrecisionMean, comm_dtype_of
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.overlap import DelayedMean
from localsgd.averaging.quantize import DEFAULT_BLOCK_SIZE
from localsgd.averaging.reduce import RoundStartMean
from localsgd.averaging.robust import Aggregate
from localsgd.averaging.robust_mean import RobustMean
from localsgd.averaging.schedule import ConstantPeriod
from localsgd.averaging.trust import Judge


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
    precision (`localsgd.averaging.compress`); `error_feedback` carries each worker's rounding
    residual into its next sync. `overlap=True`
    launches each average asynchronously in `bucket_mb` buckets and applies it one step later
    (`localsgd.averaging.overlap`; the same bits as `StreamingAverager(delay_steps=1,
    merge_rule="progress", outer=False)`, the general form the trainer runs). `link` simulates
    a slow network for every collective.

    Sharded parameters (DTensors, e.g. FSDP2's) are averaged through copies of their local
    shards (`mirror`; None: exactly when there are DTensors; see `localsgd.averaging.averager`).

    `aggregate` (a `localsgd.averaging.robust.Aggregate`) gathers every worker's change since
    the last sync and combines them robustly, dropping non-finite ones; `judge` scores and
    excludes workers (`localsgd.averaging.trust`). None: the plain all-reduced mean.

    `round_starts=True` keeps, with the plain fp32 mean, the state after each average
    (`reduce.RoundStartMean`: one more copy of the buffers), which normalized weighted rounds
    need (`Averager.normalized`); the other reducers hold it already.

    `init_sync=True` gives every rank rank 0's tensors when they are bound, as DDP does when
    built; None (the default) does so only where replicas that start apart would never meet: a
    reducer that keeps an anchor (low-precision changes, an outer optimizer). torch's averager
    does not, and a plain average brings differing replicas together at its first sync anyway.
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
        reducer: ReducerFactory | None = None,
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
        self.schedule = schedule if schedule is not None else ConstantPeriod(period)
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        if overlap and (self.schedule.needs_loss or dtype != torch.float32):
            raise ValueError("overlap needs fp32 comm_dtype and a schedule without loss feedback")
        if aggregate is None and judge is not None:
            raise ValueError("judge needs an aggregate (Aggregate('mean') for the gathered mean)")
        if aggregate is not None and (overlap or self.schedule.needs_loss):
            raise ValueError("a robust aggregate needs overlap=False and a schedule without loss "
                             "feedback")
        comm = Communicator(process_group, stats, link, guard=drop_nonfinite)
        if reducer is None and aggregate is not None:

            def reducer(flat: FlatBuffers) -> RobustMean:
                return RobustMean(
                    flat.buffers, dtype, comm.size, aggregate, judge, error_feedback=error_feedback,
                    feedback_decay=error_feedback_decay, mirror=flat,
                )

        elif reducer is None and overlap:
            bucket_bytes = int(bucket_mb * 2**20)

            def reducer(flat: FlatBuffers) -> DelayedMean:
                return DelayedMean(flat.buffers, bucket_bytes)

        elif reducer is None and dtype != torch.float32:

            def reducer(flat: FlatBuffers) -> LowPrecisionMean:
                return LowPrecisionMean(
                    flat.buffers,
                    dtype,
                    error_feedback=error_feedback,
                    feedback_decay=error_feedback_decay,
                )

        elif reducer is None and round_starts:

            def reducer(flat: FlatBuffers) -> RoundStartMean:
                return RoundStartMean(flat.buffers)

        self.comm_dtype = dtype
        self.last_average = warmup_steps - self.schedule.period_at(warmup_steps)
        super().__init__(
            [comm],
            process_group,
            module=module,
            reducer=reducer,
            warmup_steps=warmup_steps,
            init_sync=init_sync,
            mirror=mirror,
        )

    @property
    def period(self) -> int:
        return self.schedule.period_at(self.step)

    def period_of(self, level: int) -> int:
        return self.period

    @property
    def ever_averages(self) -> bool:
        return self.schedule.averages

    def extra_tensors(self, device: torch.device) -> list[torch.Tensor]:
        return self.schedule.loss_slots(device)

    def level_at(self, step: int) -> int | None:
        if step < self.warmup_steps or not self.schedule.averages:
            return None
        if self.schedule.varies:
            due = step - self.last_average >= self.schedule.period_at(step)
        else:  # torch's rule, which holds even where `step` was set from outside (a reload)
            due = (step - self.warmup_steps) % self.schedule.period == 0
        return 0 if due else None

    def next_sync(self, step: int) -> int | None:
        if self.reducer.pending and step == self.step:
            return step  # this step waits for the average in flight
        if not self.schedule.averages:
            return None
        s = max(step, self.warmup_steps)
        while self.level_at(s) is None:
            s += 1
        # with overlap the ranks wait for each other only where the average is merged
        return s + 1 if self.reducer.delays else s

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Feed this step's training loss to a schedule that adapts to it (no-op otherwise).
        Summed on the device: nothing is read back until the next sync."""
        self.schedule.observe_loss(loss)

    def _before_reduce(self) -> None:
        self.schedule.before_sync()

    def _after_reduce(self, scheduled: bool) -> None:
        if scheduled:
            self.last_average = self.step
        self.schedule.after_sync()  # the same value on every rank: the same decision

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "last_average": self.last_average,
            "schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.last_average = int(state["last_average"])
        self.schedule.load_state_dict(state["schedule"])

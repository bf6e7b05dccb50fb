"""Periodic model averaging, the local-SGD primitive, with torch's step semantics."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, SimulatedLink, all_reduce_mean_, supports_avg
from localsgd.averaging.compress import LowPrecisionMean, comm_dtype_of
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.overlap import DelayedMean
from localsgd.averaging.schedule import ConstantPeriod

# Called after every average with (process group, its size): e.g. averaging optimizer state.
AverageHook = Callable[[dist.ProcessGroup | None, int], None]


class PeriodicAverager:
    """Averages a module's parameters and floating-point buffers every `period` steps.

    A drop-in for `torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager`:
    call `step()` once after every `optimizer.step()`. With the internal counter `s` (starting at
    0), it averages when `s >= warmup_steps and (s - warmup_steps) % period == 0`, exactly as
    torch does. Unlike torch, the tensors become views of persistent flat buffers on construction,
    so an average is one in-place all-reduce per buffer and allocates nothing.

    `schedule` (see `localsgd.averaging.schedule`) replaces the fixed period: the averager then
    averages when `s >= warmup_steps` and at least `schedule.period_at(s)` steps have passed since
    its last average (the same rule for a constant period). A schedule that needs the training
    loss gets it piggybacked on the sync: one extra float in the flat buffer, fed through
    `observe_loss()`. `comm_dtype` (bfloat16 / float16) communicates in low precision, see
    `localsgd.averaging.compress`.

    `overlap=True` launches each average asynchronously (in `bucket_mb` buckets) and applies it
    one step later, keeping that step's local progress (see `localsgd.averaging.overlap`); the
    replicas then never become bit-identical until a blocking `average()`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        *,
        schedule: ConstantPeriod | None = None,
        comm_dtype: str | torch.dtype = torch.float32,
        link: SimulatedLink | None = None,
        overlap: bool = False,
        bucket_mb: float = 25.0,
    ):
        if period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        needs_loss = schedule is not None and schedule.needs_loss
        if overlap and (needs_loss or comm_dtype_of(comm_dtype) != torch.float32):
            raise ValueError("overlap needs fp32 comm_dtype and a schedule without loss feedback")
        self.schedule = schedule if schedule is not None else ConstantPeriod(period)
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.use_avg = supports_avg(process_group)
        tensors = averaged_tensors(module)
        self.loss_slot: torch.Tensor | None = None
        if self.schedule.needs_loss:
            self.loss_slot = torch.zeros(1, device=tensors[0].device)
            tensors.append(self.loss_slot)  # rides in the parameters' all-reduce
        self.loss_count = 0
        self.flat = FlatBuffers(tensors)
        self.comm_dtype = comm_dtype_of(comm_dtype)
        self.compressor = (
            LowPrecisionMean(self.flat.buffers, self.comm_dtype)
            if self.comm_dtype != torch.float32
            else None
        )
        self.stats = stats if stats is not None else CommStats()
        self.delayed: DelayedMean | None = None
        if overlap:
            self.delayed = DelayedMean(
                self.flat.buffers,
                process_group,
                self.world_size,
                self.use_avg,
                int(bucket_mb * 2**20),
                link,
            )
        self.merged = False  # this step applied a delayed average (overlap only)
        self.level_stats = CommStats()  # the averages alone (`stats` may be shared with warmup)
        self.hooks: list[AverageHook] = []
        self.link = link  # a simulated slow network, or None
        self.step_index = 0
        self.all_in_sync = True  # every rank holds the same tensors (right after an average)
        self.last_average = warmup_steps - self.schedule.period_at(warmup_steps)

    @property
    def period(self) -> int:
        return self.schedule.period_at(self.step_index)

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step belongs to the synchronous warmup."""
        return self.step_index < self.warmup_steps

    def should_average(self, step_index: int) -> bool:
        return (
            step_index >= self.warmup_steps
            and step_index - self.last_average >= self.schedule.period_at(step_index)
        )

    def averages_all(self, step_index: int) -> bool:
        """Whether the average after step `step_index` brings every rank together (with
        overlap: whether that step merges an average, every rank's, launched a step before)."""
        if self.delayed is not None:
            return self.delayed.pending
        return self.should_average(step_index)

    def next_sync(self, step_index: int) -> int:
        """The first step index >= `step_index` after which this averager will average, as the
        schedule stands now (an adaptive one changes only at a sync); with overlap, the step
        that will merge an average, the first at which the ranks wait for each other."""
        if self.delayed is not None and self.delayed.pending and step_index == self.step_index:
            return step_index  # this step waits for the average in flight
        s = max(step_index, self.warmup_steps)
        while not self.should_average(s):
            s += 1
        # with overlap the ranks wait for each other only where the average is merged
        return s + 1 if self.delayed is not None else s

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Feed this step's training loss to a schedule that adapts to it (no-op otherwise).
        Summed on the device: nothing is read back until the next sync."""
        if self.loss_slot is not None:
            self.loss_slot.add_(loss.detach())
            self.loss_count += 1

    def step(self) -> bool:
        """Call after each optimizer step; averages when the rule says. Returns whether it did."""
        self.merged = False
        if self.delayed is not None and self.delayed.pending:
            self._merge()
        averaged = self.should_average(self.step_index)
        if averaged and self.delayed is not None:
            before = self.stats.bytes
            self.delayed.launch(self.flat.buffers, self.stats)
            self._count_round(before)
        elif averaged:
            self.average()
        if averaged:
            self.last_average = self.step_index
        self.all_in_sync = averaged and self.delayed is None
        self.step_index += 1
        return averaged

    def _merge(self) -> None:
        self.delayed.merge(self.flat.buffers, self.stats)
        for hook in self.hooks:
            hook(self.process_group, self.world_size)
        self.merged = True

    def _count_round(self, bytes_before: int) -> None:
        self.stats.rounds += 1
        self.level_stats.rounds += 1
        self.level_stats.bytes += self.stats.bytes - bytes_before

    def average_parameters(self, params=None) -> None:
        """torch's name for `step()`; the parameters are the module's, fixed at construction."""
        self.step()

    def average(self) -> None:
        """Average now, outside the schedule (e.g. once more before the final evaluation),
        blocking; an average still in flight is merged first (the hooks run once, after)."""
        if self.delayed is not None and self.delayed.pending:
            self.delayed.merge(self.flat.buffers, self.stats)
        if self.loss_slot is not None and self.loss_count > 0:
            self.loss_slot.div_(self.loss_count)  # this worker's mean loss since the last sync
        before = self.stats.bytes
        self._reduce()
        for hook in self.hooks:
            hook(self.process_group, self.world_size)
        self._count_round(before)
        self.all_in_sync = True
        if self.loss_slot is not None:
            synced = float(self.loss_slot.item()) if self.loss_count > 0 else None
            self.loss_slot.zero_()
            self.loss_count = 0
            self.schedule.update(synced)  # the same value on every rank: the same decision

    def _reduce(self) -> None:
        if self.compressor is not None:
            self.compressor.all_reduce_mean_(
                self.flat.buffers, 0, self.process_group, self.world_size, self.use_avg, self.stats
            )
            return
        for flat in self.flat.buffers:
            all_reduce_mean_(
                flat, self.process_group, self.world_size, self.use_avg, self.stats, link=self.link
            )

    def broadcast_(self, src: int = 0) -> None:
        """Give every rank rank `src`'s tensors (not counted as training communication)."""
        for flat in self.flat.buffers:
            dist.broadcast(flat, src=src, group=self.process_group)
        self.reanchor()

    def reanchor(self) -> None:
        """The replicas are identical now (after the initial broadcast): take them as the anchor
        that compressed and outer-optimizer averaging measure the change from."""
        if self.compressor is not None:
            self.compressor.reset(self.flat.buffers)

    def comm_levels(self) -> list[dict]:
        """Per-level communication of the averages (one level here), for summaries."""
        return [
            {
                "group_size": self.world_size,
                "period": self.period,
                "rounds": self.level_stats.rounds,
                "bytes": self.level_stats.bytes,
            }
        ]

    def state_dict(self) -> dict:
        state = {
            "step": self.step_index,
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "last_average": self.last_average,
            "schedule": self.schedule.state_dict(),
            "level_stats": self.level_stats.state_dict(),
        }
        if self.loss_slot is not None:  # the loss summed since the last sync, for an exact resume
            state["loss_slot"] = self.loss_slot.detach().clone()
            state["loss_count"] = self.loss_count
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        if self.delayed is not None:
            state["delayed"] = self.delayed.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])
        if "last_average" in state:
            self.last_average = int(state["last_average"])
            self.schedule.load_state_dict(state["schedule"])
            self.level_stats.load_state_dict(state["level_stats"])
        else:  # a state that saved only the step (a constant period): where was the last average
            last, k = self.step_index - 1, self.schedule.period_at(0)
            w = self.warmup_steps
            self.last_average = last - (last - w) % k if last >= w else w - k
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])
        if self.delayed is not None:
            self.delayed.load_state_dict(state.get("delayed", {}))
        if self.loss_slot is not None and "loss_slot" in state:
            self.loss_slot.copy_(state["loss_slot"])
            self.loss_count = int(state["loss_count"])

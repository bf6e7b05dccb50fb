"""Outer optimizers over the average: DiLoCo (Douillard et al. 2023) and SlowMo (Wang et al. 2020).

Every worker keeps the anchor, the model as of the last sync, in its own flat buffer. At a sync
the pseudo-gradient `anchor - mean(local)` (how far the workers moved, on average, negated) is
the gradient of a torch optimizer over the anchor; every worker then continues from the new
anchor. The anchor, the pseudo-gradient and the optimizer state are the same on every rank (the
same bytes in, the same deterministic update), so the replicas stay bit-identical.

With outer SGD at lr 1 and no momentum the new anchor is `anchor - (anchor - mean(local))`, i.e.
plain averaging. The first sync after a warmup is a plain average too: the anchor is still the
initial model, and extrapolating the whole warmup's progress by the outer momentum would overshoot.
Floating-point buffers (BatchNorm statistics) are averaged plainly, never
extrapolated by momentum (a running variance could go negative).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, SimulatedLink
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.offload import check_outer_state
from localsgd.averaging.periodic import PeriodicAverager
from localsgd.averaging.rounds import DILOCO, OUTER_DEFAULTS, Rounds, outer_step, whole
from localsgd.averaging.rounds.part import Part
from localsgd.averaging.schedule import ConstantPeriod
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.averaging.wire.compress import CommFormat, comm_dtype_of
from localsgd.averaging.wire.quantize import DEFAULT_BLOCK_SIZE

__all__ = ["DILOCO", "OUTER_DEFAULTS", "OuterAverager", "outer_step"]


class OuterAverager(PeriodicAverager):
    """`PeriodicAverager` whose average feeds the pseudo-gradient to an outer SGD.

    `outer_lr`, `outer_momentum`, `outer_nesterov` configure the outer `torch.optim.SGD`
    (DiLoCo: 0.7, 0.9, Nesterov; SlowMo: slow learning rate alpha, slow momentum beta).
    With `comm_dtype` bfloat16/float16 the pseudo-gradient is communicated in that precision;
    with int8/float8_e4m3fn/int4/float4_e2m1 it is block-quantised with one fp32 scale per
    `quant_block_size` values (`localsgd.averaging.wire.quantize`). `error_feedback` adds each
    worker's rounding residual to its next pseudo-gradient (checkpointed; see `compress`),
    times `error_feedback_decay` (1: every error is kept).
    `outer_warmup_rounds` = R moves the first R outer steps linearly from a plain average to the
    configured step (`outer_step`). `outer_state="cpu"` keeps the anchor and the outer momentum
    in host memory (pinned where CUDA is available) and runs the outer step there, with the
    same bits (`localsgd.averaging.offload`).
    `split`: the parts its rounds run on (None: the whole model; asynchronous rounds' fragments,
    `localsgd.averaging.asynchronous.averager`).
    `aggregate`/`judge`: the pseudo-gradients gathered and combined robustly, non-finite ones
    dropped, workers scored and excluded (`localsgd.averaging.trust.trusted_round`); None: the mean.
    The anchor must exist from the start, so `module` is required. The outer step moves the
    anchor by the mean pseudo-gradient, so anchors that differed when built would never meet:
    with `init_sync` (the default) every rank starts from rank 0's parameters and buffers.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: torch.nn.Module,
        stats: CommStats | None = None,
        outer_lr: float = DILOCO["lr"],
        outer_momentum: float = DILOCO["momentum"],
        outer_nesterov: bool = DILOCO["nesterov"],
        schedule: ConstantPeriod | None = None,
        comm_dtype: str | CommFormat = torch.float32,
        link: SimulatedLink | None = None,
        init_sync: bool = True,
        error_feedback: bool = False,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        outer_warmup_rounds: int = 0,
        mirror: bool | None = None,
        outer_state: str = "device",
        aggregate: Aggregate | None = None,
        judge: Judge | None = None,
        error_feedback_decay: float = 1.0,
        drop_nonfinite: bool = True,
        split: Callable[[FlatBuffers], list[Part]] | None = None,
    ):
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        host = check_outer_state(outer_state)
        self.outer_state = outer_state
        if outer_warmup_rounds < 0:
            raise ValueError(f"outer_warmup_rounds must be >= 0, got {outer_warmup_rounds}")

        if aggregate is None and judge is not None:
            raise ValueError("judge needs an aggregate (Aggregate('mean') for the gathered mean)")
        size = dist.get_world_size(process_group)
        sgd = {"lr": outer_lr, "momentum": outer_momentum, "nesterov": outer_nesterov,
               "warmup_rounds": outer_warmup_rounds}  # fmt: skip

        def make_rounds(flat: FlatBuffers) -> Rounds:
            return Rounds(
                flat,
                [whole(flat)] if split is None else split(flat),
                size=size,
                contribution="pseudo_gradient",
                outer=sgd,
                host=host,
                fmt=dtype,
                error_feedback=error_feedback,
                feedback_decay=error_feedback_decay,
                aggregate=aggregate,
                judge=judge,
            )

        super().__init__(
            period,
            warmup_steps,
            process_group,
            module=module,
            stats=stats,
            schedule=schedule,
            link=link,
            rounds=make_rounds,
            init_sync=init_sync,
            mirror=mirror,
            drop_nonfinite=drop_nonfinite,
        )
        self.comm_dtype = dtype  # what goes on the wire (PeriodicAverager set float32)

    def is_plain(self, p: int, step: int) -> bool:
        # the first sync after a warmup (the rule fires at step `warmup_steps`): see the module doc
        return self.warmup_steps > 0 and step == self.warmup_steps

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.rounds.outer.optimizers[0]

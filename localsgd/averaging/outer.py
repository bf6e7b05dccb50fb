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

import copy

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.compress import (
    CommFormat,
    comm_dtype_of,
    load_residuals,
    lossy_mean_,
    residual_buffers,
    wire_buffers,
)
from localsgd.averaging.flat import FlatBuffers, Relayout
from localsgd.averaging.periodic import PeriodicAverager
from localsgd.averaging.quantize import DEFAULT_BLOCK_SIZE, BlockCodec
from localsgd.averaging.reduce import Reducer
from localsgd.averaging.schedule import ConstantPeriod

OUTER_DEFAULTS = {  # the papers' settings
    "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "slowmo": {"lr": 1.0, "momentum": 0.5, "nesterov": False},
}


def outer_step(optimizer: torch.optim.Optimizer, warmup_rounds: int):
    """`optimizer.step()` with the outer warmup: outer step r (counted from 0, per optimizer) of
    the first `warmup_rounds` uses lr `1 + (r / R)(lr - 1)` and momentum `(r / R) momentum` (lr and
    momentum as the optimizer was built, `optimizer.defaults`), so
    the first outer step is a plain average (lr 1, no momentum) and the method's own step is
    reached at step R. With few outer steps, momentum 0.9 started at once extrapolates the
    earliest pseudo-gradients, taken far from any minimum, for the rest of the run. The count
    lives in the param group (`outer_rounds`), so the optimizer's state_dict checkpoints it."""
    lr, momentum = optimizer.defaults["lr"], optimizer.defaults["momentum"]
    for group in optimizer.param_groups:
        done = group.get("outer_rounds", 0)
        if warmup_rounds > 0:
            f = min(1.0, done / warmup_rounds)
            group["lr"] = 1.0 + f * (lr - 1.0)
            group["momentum"] = f * momentum
        group["outer_rounds"] = done + 1
    optimizer.step()


class OuterStep(Reducer):
    """The reducer of `OuterAverager`: the mean pseudo-gradient fed to an outer `torch.optim.SGD`
    over the anchor (communicated in `comm_dtype`, a dtype or a block-quantised format; anchor
    and outer state stay fp32). `error_feedback` keeps this worker's residual, what it wanted to
    send minus what it sent, and adds it to its next pseudo-gradient (see `compress`)."""

    anchored = True

    def __init__(
        self,
        flat: FlatBuffers,
        warmup_steps: int,
        lr: float,
        momentum: float,
        nesterov: bool,
        comm_dtype: CommFormat,
        error_feedback: bool = False,
        warmup_rounds: int = 0,
    ):
        self.warmup_steps = warmup_steps
        self.warmup_rounds = warmup_rounds
        self.error_feedback = error_feedback
        self.anchors: list[torch.Tensor] = []
        self.param_numels: list[int] = []
        outer_params = []
        for buffer, members in zip(flat.buffers, flat.groups, strict=True):
            anchor = buffer.detach().clone()
            # averaged_tensors lists parameters first, so they lead every buffer
            n = sum(t.numel() for t in members if isinstance(t, torch.nn.Parameter))
            if n > 0:
                view = anchor[:n]
                view.grad = buffer[:n]  # the pseudo-gradient is computed in place in the buffer
                outer_params.append(view)
            self.anchors.append(anchor)
            self.param_numels.append(n)
        self.low = wire_buffers(flat.buffers, comm_dtype_of(comm_dtype))
        self.residuals = residual_buffers(flat.buffers, self.low, error_feedback)
        self.optimizer = torch.optim.SGD(outer_params, lr=lr, momentum=momentum, nesterov=nesterov)

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        # the first sync after a warmup (the rule fires at step `warmup_steps`), see the module doc
        plain = self.warmup_steps > 0 and step == self.warmup_steps
        for flat, anchor, low, residual, n in zip(
            buffers, self.anchors, self.low, self.residuals, self.param_numels, strict=True
        ):
            torch.sub(anchor, flat, out=flat)  # pseudo-gradient
            lossy_mean_(flat, comm, low, residual)
            start = 0 if plain else n  # buffers (or everything) are averaged plainly
            anchor[start:].sub_(flat[start:])
        if not plain:
            outer_step(self.optimizer, self.warmup_rounds)
        for flat, anchor in zip(buffers, self.anchors, strict=True):
            flat.copy_(anchor)

    def reset(self, buffers: list[torch.Tensor]) -> None:
        for flat, anchor in zip(buffers, self.anchors, strict=True):
            anchor.copy_(flat)
        for residual in self.residuals:
            if residual is not None:
                residual.zero_()

    def relayout(self, convert: Relayout) -> None:
        raise ValueError(
            "a parameter changed dtype or device under an outer optimizer (DiLoCo/SlowMo): "
            "move the model (model.to(...)) before building the averager"
        )

    def state_dict(self) -> dict:
        state = {
            "anchors": [a.clone() for a in self.anchors],
            "outer_optimizer": self.optimizer.state_dict(),
        }
        if self.error_feedback:
            state["residuals"] = [r.clone() if r is not None else None for r in self.residuals]
        return state

    def load_state_dict(self, state: dict) -> None:
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        # deep-copied: torch's load_state_dict would otherwise share the momentum tensors with
        # `state`, e.g. with the live averager it was taken from
        self.optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        load_residuals(self.residuals, state.get("residuals"))


class OuterAverager(PeriodicAverager):
    """`PeriodicAverager` whose average feeds the pseudo-gradient to an outer SGD.

    `outer_lr`, `outer_momentum`, `outer_nesterov` configure the outer `torch.optim.SGD`
    (DiLoCo: 0.7, 0.9, Nesterov; SlowMo: slow learning rate alpha, slow momentum beta).
    With `comm_dtype` bfloat16/float16 the pseudo-gradient is communicated in that precision;
    with int8/float8_e4m3fn/int4/float4_e2m1 it is block-quantised with one fp32 scale per
    `quant_block_size` values (`localsgd.averaging.quantize`). `error_feedback` adds each
    worker's rounding residual to its next pseudo-gradient (checkpointed; see `compress`).
    `outer_warmup_rounds` = R moves the first R outer steps linearly from a plain average to the
    configured step (`outer_step`).
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
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        schedule: ConstantPeriod | None = None,
        comm_dtype: str | torch.dtype | BlockCodec = torch.float32,
        link: SimulatedLink | None = None,
        init_sync: bool = True,
        error_feedback: bool = False,
        quant_block_size: int = DEFAULT_BLOCK_SIZE,
        outer_warmup_rounds: int = 0,
    ):
        dtype = comm_dtype_of(comm_dtype, quant_block_size)
        if outer_warmup_rounds < 0:
            raise ValueError(f"outer_warmup_rounds must be >= 0, got {outer_warmup_rounds}")

        def make_reducer(flat: FlatBuffers) -> Reducer:
            return OuterStep(
                flat,
                warmup_steps,
                outer_lr,
                outer_momentum,
                outer_nesterov,
                dtype,
                error_feedback=error_feedback,
                warmup_rounds=outer_warmup_rounds,
            )

        super().__init__(
            period,
            warmup_steps,
            process_group,
            module=module,
            stats=stats,
            schedule=schedule,
            link=link,
            reducer=make_reducer,
            init_sync=init_sync,
        )
        self.comm_dtype = dtype  # what goes on the wire (PeriodicAverager set float32)

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        return self.reducer.optimizer

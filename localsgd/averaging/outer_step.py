"""The outer step over a pseudo-gradient, as a reducer: DiLoCo's (Douillard et al. 2023) and
SlowMo's (Wang et al. 2020) defaults, `outer_step` (with its warmup) and `OuterStep`, the reducer
that `OuterAverager` runs at each average. Streaming DiLoCo's fragments (`fragments.py`) take
the same `outer_step`; this module imports no averager."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.compress import (
    CommFormat,
    comm_dtype_of,
    load_residuals,
    lossy_mean_,
    residual_buffers,
    wire_buffers,
)
from localsgd.averaging.flat import FlatBuffers, Relayout, param_lead
from localsgd.averaging.offload import host_clone, host_empty_like
from localsgd.averaging.reduce import Reducer, scale_change_

if TYPE_CHECKING:
    from localsgd.averaging.trust import TrustedRound

OUTER_DEFAULTS = {  # the papers' settings: the one place they are written
    "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "slowmo": {"lr": 1.0, "momentum": 0.5, "nesterov": False},
}
DILOCO = OUTER_DEFAULTS["diloco"]  # the averagers' defaults


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
    send minus what it sent, and adds it to its next pseudo-gradient (see `compress`). `host`:
    the anchor and outer momentum in host memory, the outer step run there (`offload`)."""

    anchored = True
    scales_changes = True

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
        host: bool = False,
        trusted: Callable[[list[torch.Tensor], list], TrustedRound] | None = None,
        feedback_decay: float = 1.0,
    ):
        self.warmup_steps = warmup_steps
        self.host = host
        self.warmup_rounds = warmup_rounds
        self.error_feedback = error_feedback
        self.feedback_decay = feedback_decay  # beta of `e <- beta e + d` (compress)
        self.anchors: list[torch.Tensor] = []
        self.param_numels: list[int] = []
        outer_params = []
        lead = param_lead(flat)
        # host: where the mean pseudo-gradient lands for the outer step (see `offload`)
        self.staging = [host_empty_like(b) for b in flat.buffers] if host else []
        for g, (buffer, n) in enumerate(zip(flat.buffers, lead, strict=True)):
            anchor = host_clone(buffer) if host else buffer.detach().clone()
            if n > 0:
                view = anchor[:n]
                # the pseudo-gradient is computed in place in the buffer (host: in its staging)
                view.grad = self.staging[g][:n] if host else buffer[:n]
                outer_params.append(view)
            self.anchors.append(anchor)
            self.param_numels.append(n)
        self.low = wire_buffers(flat.buffers, comm_dtype_of(comm_dtype))
        self.residuals = residual_buffers(flat.buffers, self.low, error_feedback)
        self.optimizer = torch.optim.SGD(outer_params, lr=lr, momentum=momentum, nesterov=nesterov)
        # a robust aggregate over the pseudo-gradients (`trust.TrustedRound`); None: the mean
        self.trust = trusted(flat.buffers, self.low) if trusted is not None else None

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        # the first sync after a warmup (the rule fires at step `warmup_steps`), see the module doc
        plain = self.warmup_steps > 0 and step == self.warmup_steps
        staging = self.staging or [None] * len(buffers)
        if self.trust is not None:  # (sync.outer_state=cpu with a robust aggregate: refused)
            if self.change_scale is not None:
                raise ValueError("a weighted round's scaled changes with a robust aggregate")
            for flat, anchor in zip(buffers, self.anchors, strict=True):
                torch.sub(anchor, flat, out=flat)  # pseudo-gradient
            self.trust.run_(buffers, self.anchors, comm, self.residuals, step)
            means = buffers
        else:
            means = []
            for g, (flat, anchor, low, residual, stage) in enumerate(
                zip(buffers, self.anchors, self.low, self.residuals, staging, strict=True)
            ):
                if stage is None:
                    torch.sub(anchor, flat, out=flat)  # pseudo-gradient
                    scale_change_(flat, g, self.change_scale)
                    lossy_mean_(flat, comm, low, residual, self.feedback_decay)
                    means.append(flat)
                else:  # the same arithmetic on the host; the wire stays on the device
                    stage.copy_(flat)
                    torch.sub(anchor, stage, out=stage)
                    flat.copy_(stage)
                    scale_change_(flat, g, self.change_scale)
                    lossy_mean_(flat, comm, low, residual, self.feedback_decay)
                    means.append(stage.copy_(flat))
        # the common pseudo-gradient moves the anchor, which every rank copies
        for mean, anchor, n in zip(means, self.anchors, self.param_numels, strict=True):
            start = 0 if plain else n  # buffers (or everything) are averaged plainly
            anchor[start:].sub_(mean[start:])
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
        if self.trust is not None:
            state["trust"] = self.trust.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        # deep-copied: torch's load_state_dict would otherwise share the momentum tensors with
        # `state`, e.g. with the live averager it was taken from
        self.optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))
        load_residuals(self.residuals, state.get("residuals"))
        if self.trust is not None:
            self.trust.load_state_dict(state.get("trust", {}))

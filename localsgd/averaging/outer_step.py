"""The outer step over a pseudo-gradient, as a reducer: DiLoCo's (Douillard et al. 2023) and
SlowMo's (Wang et al. 2020) defaults, `outer_step` (with its warmup) and `OuterStep`, the reducer
that `OuterAverager` runs at each average. Streaming DiLoCo's fragments (`fragments.py`) take
the same `outer_step`; this module imports no averager."""

from __future__ import annotations

import copy

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
from localsgd.averaging.flat import FlatBuffers, Relayout
from localsgd.averaging.reduce import Reducer

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
        feedback_decay: float = 1.0,
    ):
        self.warmup_steps = warmup_steps
        self.warmup_rounds = warmup_rounds
        self.error_feedback = error_feedback
        self.feedback_decay = feedback_decay  # beta of `e <- beta e + d` (compress)
        self.anchors: list[torch.Tensor] = []
        self.param_numels: list[int] = []
        outer_params = []
        # averaged_tensors lists parameters first, so they lead every buffer; counted from the
        # slots, which hold what this rank has of each (a sharded parameter's local shard)
        lead = [0] * len(flat.buffers)
        for t, (g, _, numel) in zip(flat.tensors, flat.slots, strict=True):
            lead[g] += numel if isinstance(t, torch.nn.Parameter) else 0
        for buffer, n in zip(flat.buffers, lead, strict=True):
            anchor = buffer.detach().clone()
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
            lossy_mean_(flat, comm, low, residual, self.feedback_decay)
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

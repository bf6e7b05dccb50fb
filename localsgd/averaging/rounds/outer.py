"""The outer stage of a round: from the combined contribution to the part's new global values.

- a `values` mean *is* the global value;
- a mean `change` is added to the anchor: `anchor + mean(local - anchor)`;
- a mean `pseudo_gradient` is the gradient of an outer `torch.optim.SGD` over the anchor's
  parameters (DiLoCo: lr 0.7, momentum 0.9, Nesterov; SlowMo: its slow lr and momentum), one
  optimizer per part; the part's floating-point buffers (BatchNorm statistics) take it plainly,
  `anchor - mean`, never extrapolated by momentum, and so does everything at the part's first
  round after a synchronous warmup (`plain`: the anchor is still the initial model, and the
  momentum would overshoot the warmup's progress).

The anchors (`Anchors`) are the global values as of each part's last sync, the same on every
rank, laid out as the flat buffers; in host memory with `host` (`sync.outer_state=cpu`: the mean
is staged to the host, the step runs there, the new values are copied back; the same bits,
`localsgd.averaging.offload`).
"""

from __future__ import annotations

import copy

import torch

from localsgd.averaging.flat import Relayout
from localsgd.averaging.offload import host_clone, host_empty_like
from localsgd.averaging.rounds.part import Part, Tensors

OUTER_DEFAULTS = {  # the papers' settings: the one place they are written
    "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "slowmo": {"lr": 1.0, "momentum": 0.5, "nesterov": False},
}
DILOCO = OUTER_DEFAULTS["diloco"]  # the averagers' defaults


def outer_step(optimizer: torch.optim.Optimizer, warmup_rounds: int) -> None:
    """`optimizer.step()` with the outer warmup: outer step r (counted from 0, per optimizer) of
    the first `warmup_rounds` uses lr `1 + (r / R)(lr - 1)` and momentum `(r / R) momentum` (lr
    and momentum as the optimizer was built, `optimizer.defaults`), so the first outer step is a
    plain average (lr 1, no momentum) and the method's own step is reached at step R. With few
    outer steps, momentum 0.9 started at once extrapolates the earliest pseudo-gradients, taken
    far from any minimum, for the rest of the run. The count lives in the param group
    (`outer_rounds`), so the optimizer's state_dict checkpoints it."""
    lr, momentum = optimizer.defaults["lr"], optimizer.defaults["momentum"]
    for group in optimizer.param_groups:
        done = group.get("outer_rounds", 0)
        if warmup_rounds > 0:
            f = min(1.0, done / warmup_rounds)
            group["lr"] = 1.0 + f * (lr - 1.0)
            group["momentum"] = f * momentum
        group["outer_rounds"] = done + 1
    optimizer.step()


class Anchors:
    """The global values as of each part's last sync, laid out as the flat buffers: one set, or
    one per hierarchical level (set l: the values after the last sync at level l or wider,
    which every member of a level-l group holds)."""

    def __init__(self, buffers: Tensors, levels: int = 1, host: bool = False):
        self.host = host
        keep = host_clone if host else (lambda b: b.detach().clone())
        self.sets = [[keep(b) for b in buffers] for _ in range(levels)]

    def at(self, level: int = 0) -> Tensors:
        """The set of level `level` (one set serves every level: the widest's)."""
        return self.sets[min(level, len(self.sets) - 1)]

    @property
    def first(self) -> Tensors:
        return self.sets[0]

    def settle_(self, part: Part, level: int, values: Tensors) -> None:
        """After a round at `level`: the sets of that level and the narrower ones take
        `values` (the part's new global values)."""
        for anchors in self.sets[: level + 1]:
            for (g, s, _, e), v in zip(part, values, strict=True):
                if anchors[g][s:e].data_ptr() != v.data_ptr():
                    anchors[g][s:e].copy_(v)

    def reset(self, buffers: Tensors) -> None:
        for anchors in self.sets:
            for anchor, flat in zip(anchors, buffers, strict=True):
                anchor.copy_(flat)

    def relayout(self, convert: Relayout) -> None:
        self.sets = [convert(anchors) for anchors in self.sets]

    def state_dict(self) -> dict:
        state = {"anchors": [a.clone() for a in self.sets[0]]}
        if len(self.sets) > 1:
            state["level_anchors"] = [[a.clone() for a in s] for s in self.sets[1:]]
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = [state["anchors"], *state.get("level_anchors", [])]
        for anchors, values in zip(self.sets, saved, strict=False):
            for anchor, value in zip(anchors, values, strict=True):
                anchor.copy_(value)


class OuterSGD:
    """An outer `torch.optim.SGD` per part over its anchor's parameters (`sgd`: its lr,
    momentum, nesterov and `warmup_rounds`; `optimizer`: another torch optimizer class taking
    those, e.g. asynchronous rounds' `DelayedNesterov`); with `host`, a staging copy per part
    where the mean lands for the step (also the host scratch of the pseudo-gradient,
    `Contribution`)."""

    def __init__(self, parts: list[Part], anchors: Anchors, sgd: dict, host: bool = False):
        sgd = dict(sgd)
        self.warmup_rounds = sgd.pop("warmup_rounds", 0)
        optimizer = sgd.pop("optimizer", torch.optim.SGD)
        self.anchors, self.host = anchors, host
        self.optimizers: list[torch.optim.Optimizer | None] = []
        for part in parts:
            params = [anchors.first[g][s:n] for g, s, n, _ in part if n > s]
            self.optimizers.append(optimizer(params, **sgd) if params else None)
        self.staging = (
            [[host_empty_like(anchors.first[g][s:e]) for g, s, _, e in part] for part in parts]
            if host
            else []
        )

    def step_(self, p: int, part: Part, mean: Tensors, plain: bool) -> Tensors:
        """Step part p's anchor by the mean pseudo-gradient `mean`; returns the new global
        values on the buffers' device (`mean` overwritten with them under `host`, else the
        anchor's views)."""
        grads = mean
        if self.host:
            grads = self.staging[p]
            for h, d in zip(grads, mean, strict=True):
                h.copy_(d)
        anchors = self.anchors.first
        for (g, s, n, e), d in zip(part, grads, strict=True):
            start = 0 if plain else n - s
            anchors[g][s + start : e].sub_(d[start:])
        opt = self.optimizers[p]
        if opt is not None and not plain:
            views = [d[: n - s] for (_, s, n, _), d in zip(part, grads, strict=True)]
            for param, d in zip(
                opt.param_groups[0]["params"], [v for v in views if v.numel()], strict=True
            ):
                param.grad = d
            outer_step(opt, self.warmup_rounds)
        if not self.host:
            return [anchors[g][s:e] for g, s, _, e in part]
        for (g, s, _, e), d in zip(part, mean, strict=True):
            d.copy_(anchors[g][s:e])
        return mean

    def state_dict(self) -> list:
        return [o.state_dict() if o is not None else None for o in self.optimizers]

    def load_state_dict(self, saved: list) -> None:
        for opt, state in zip(self.optimizers, saved, strict=True):
            if opt is not None:  # deep-copied: not sharing momentum with `saved`
                opt.load_state_dict(copy.deepcopy(state))

"""Muon on the weight matrices, AdamW on the rest: MuLoCo's inner optimizer (arXiv 2505.23725).

`torch.optim.Muon` (torch 2.13) orthogonalises the momentum of a 2-D weight by Newton-Schulz
iterations; it is defined for matrices only, and the papers that use it (Keller Jordan's Muon,
Moonshot's "Muon is scalable", MuLoCo) leave the embeddings and the output head to AdamW, with
biases, norms and every tensor of another shape. `muon_parameters` draws that line from the
module: the 2-D weights of every module except `nn.Embedding`s and the head, the last
`nn.Linear` in `module.modules()` order (the layer that produces the logits; a head tied to an
embedding is that embedding's weight, excluded either way).

`MuonAdamW` is one `torch.optim.Optimizer` over two inner ones that share its parameter groups
(Muon's first, then AdamW's) and its `state`: the loop, the LR schedule (each group keeps its
peak `lr` as `initial_lr`), `sync.optimizer_state`, checkpoints and resharding all see one
optimizer whose `state_dict()` holds both. One `lr` and one `weight_decay` serve both by
default: Muon's `adjust_lr_fn="match_rms_adamw"` scales its update to AdamW's RMS
(Moonshot's recipe), so `optim=muon` takes the learning rate `optim=adamw` takes.

Sharded (`dist.shard_size > 1`, FSDP2's DTensor parameters): Newton-Schulz needs the whole
matrix, while the momentum and the weight decay are elementwise. `ShardedMuon` keeps the
momentum on the local shards, gathers each matrix's update from its replica group's shards
(`full_tensor`, one all-gather inside the group, as FSDP's own forward does), orthogonalises the
whole matrix with torch's own `_zeropower_via_newtonschulz` on every rank of the group (the same
bits on each), and keeps this rank's shard of the result: the same arithmetic as
`torch.optim.Muon` on the unsharded matrix (MuLoCo at any size).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from localsgd.averaging.flat import is_dtensor


def muon_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon trains: the 2-D weights of `module`, except embeddings and the head
    (see the module doc), in `module.parameters()` order."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    head = linears[-1].weight if linears else None
    excluded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    if head is not None:
        excluded.add(id(head))
    return [p for p in module.parameters() if p.dim() == 2 and id(p) not in excluded]


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` over sharded matrices (see the module doc)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                whole = update.full_tensor() if is_dtensor(update) else update
                ortho = _zeropower_via_newtonschulz(
                    whole, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                if is_dtensor(p):  # this rank's shard of what every rank of the group computed
                    from torch.distributed.tensor import distribute_tensor

                    mesh, placements = p.device_mesh, p.placements
                    ortho = distribute_tensor(ortho, mesh, placements, src_data_rank=None)
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-adjusted)
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on `muon_parameters(module)`, `torch.optim.AdamW` on the rest of
    `params` (see the module doc). `lr` and `weight_decay` are both optimizers' (a group's `lr`
    is what the schedule scales); `momentum`, `nesterov`, `ns_steps` and `adjust_lr_fn` are
    Muon's, `betas` and `eps` AdamW's. `localsgd.loop.optim.build_optimizer` passes `module`."""

    takes_module = True  # build_optimizer passes the model: the split needs its modules

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        module: nn.Module,
        lr: float = 4e-4,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        params = list(params)
        chosen = {id(p) for p in muon_parameters(module)}
        matrices = [p for p in params if id(p) in chosen]
        rest = [p for p in params if id(p) not in chosen]
        if not matrices:
            raise ValueError(
                f"Muon trains 2-D weight matrices (not embeddings or the output head), and "
                f"{type(module).__name__} has none: it would train AdamW alone"
            )
        muon = ShardedMuon if any(is_dtensor(p) for p in matrices) else torch.optim.Muon
        self.muon = (
            muon(
                matrices,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            )
            if matrices
            else None
        )
        self.adamw = (
            torch.optim.AdamW(rest, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
            if rest
            else None
        )
        groups = [g for o in self._inner() for g in o.param_groups]
        for o in self._inner():
            for g in o.param_groups:
                g["inner"] = "muon" if o is self.muon else "adamw"  # in the state_dict, readable
        super().__init__(groups, {"lr": lr})  # the same group dicts: the inner ones see changes
        self._link()

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after
        `load_state_dict`, which replaces both)."""
        muon = [g for g in self.param_groups if g["inner"] == "muon"]
        adamw = [g for g in self.param_groups if g["inner"] == "adamw"]
        for opt, groups in ((self.muon, muon), (self.adamw, adamw)):
            if opt is not None:
                opt.param_groups = groups
                opt.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner():
            opt.step()
        return loss

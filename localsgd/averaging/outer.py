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

from localsgd.averaging.comm import CommStats, SimulatedLink
from localsgd.averaging.compress import all_reduce_mean_through_
from localsgd.averaging.periodic import PeriodicAverager
from localsgd.averaging.schedule import ConstantPeriod

OUTER_DEFAULTS = {  # the papers' settings
    "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "slowmo": {"lr": 1.0, "momentum": 0.5, "nesterov": False},
}


class OuterAverager(PeriodicAverager):
    """`PeriodicAverager` whose average feeds the pseudo-gradient to an outer SGD.

    `outer_lr`, `outer_momentum`, `outer_nesterov` configure the outer `torch.optim.SGD`
    (DiLoCo: 0.7, 0.9, Nesterov; SlowMo: slow learning rate alpha, slow momentum beta).
    With `comm_dtype` bfloat16/float16 the pseudo-gradient is communicated in that precision;
    the anchor and the outer state stay in fp32.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        schedule: ConstantPeriod | None = None,
        comm_dtype: str | torch.dtype = torch.float32,
        link: SimulatedLink | None = None,
    ):
        super().__init__(
            module,
            period,
            warmup_steps,
            process_group,
            stats,
            schedule=schedule,
            comm_dtype=comm_dtype,
            link=link,
        )
        self.compressor = None  # the pseudo-gradient is what gets compressed, below
        param_ids = {id(p) for p in module.parameters()}
        self.anchors: list[torch.Tensor] = []
        self.low: list[torch.Tensor | None] = []
        self.param_numels: list[int] = []
        outer_params = []
        for flat, members in zip(self.flat.buffers, self.flat.groups, strict=True):
            anchor = flat.detach().clone()
            # averaged_tensors lists parameters first, so they lead every buffer
            n = sum(t.numel() for t in members if id(t) in param_ids)
            if n > 0:
                view = anchor[:n]
                view.grad = flat[:n]  # the pseudo-gradient is computed in place in `flat`
                outer_params.append(view)
            self.anchors.append(anchor)
            self.param_numels.append(n)
            low = None
            if self.comm_dtype != torch.float32:
                low = torch.empty(flat.numel(), dtype=self.comm_dtype, device=flat.device)
            self.low.append(low)
        self.outer_optimizer = torch.optim.SGD(
            outer_params,
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=outer_nesterov,
        )

    def _reduce(self) -> None:
        # the first sync after a warmup (the rule fires at step `warmup_steps`), see the module doc
        plain = self.warmup_steps > 0 and self.step_index == self.warmup_steps
        for flat, anchor, low, n in zip(
            self.flat.buffers, self.anchors, self.low, self.param_numels, strict=True
        ):
            torch.sub(anchor, flat, out=flat)  # pseudo-gradient
            all_reduce_mean_through_(
                flat, low, self.process_group, self.world_size, self.use_avg, self.stats
            )
            start = 0 if plain else n  # buffers (or everything) are averaged plainly
            anchor[start:].sub_(flat[start:])
        if not plain:
            self.outer_optimizer.step()
        for flat, anchor in zip(self.flat.buffers, self.anchors, strict=True):
            flat.copy_(anchor)

    def reanchor(self) -> None:
        for flat, anchor in zip(self.flat.buffers, self.anchors, strict=True):
            anchor.copy_(flat)

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "anchors": [a.clone() for a in self.anchors],
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        # deep-copied: torch's load_state_dict would otherwise share the momentum tensors with
        # `state`, e.g. with the live averager it was taken from
        self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))

"""Synchronous mini-batch SGD for the warmup: gradients averaged over one flat buffer per step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import averaged_tensors


class GradientAverager:
    """Averages the gradients of a module's parameters with one all-reduce per flat buffer.

    Each `p.grad` is made a view into a persistent flat buffer (as DDP's `gradient_as_bucket_view`),
    so autograd accumulates straight into it. If something replaced a gradient (e.g.
    `zero_grad(set_to_none=True)`), it is copied back in before the reduction; a parameter that got
    no gradient contributes zeros, the same on every rank, so replicas stay identical.

    Averaged gradients keep replicas together only if they start together: with `init_sync`
    (the default) every rank gets rank 0's parameters and floating-point buffers when this is
    built, as DDP does (setup, not counted as training communication).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
        init_sync: bool = True,
    ):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.comm = Communicator(process_group, stats, link)
        if init_sync:
            for tensor in averaged_tensors(module):
                self.comm.broadcast_(tensor.data, src=0)
        self.stats = self.comm.stats
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buffers: list[torch.Tensor] = []
        self.bindings: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for (device, dtype), members in groups.items():
            flat = torch.zeros(sum(p.numel() for p in members), device=device, dtype=dtype)
            offset = 0
            for p in members:
                view = flat[offset : offset + p.numel()].view(p.shape)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self.bindings.append((p, view))
                offset += p.numel()
            self.buffers.append(flat)

    def _rebind(self) -> None:
        for p, view in self.bindings:
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def all_reduce(self) -> None:
        """Replace every gradient by its mean over the group; one communication round."""
        self._rebind()
        for flat in self.buffers:
            self.comm.mean_(flat)
        self.stats.rounds += 1

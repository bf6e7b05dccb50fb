"""Synchronous mini-batch SGD for the warmup: gradients averaged over one flat buffer per step.

Sharded parameters (FSDP2's DTensors, `dist.shard_size` > 1) are mirrored instead of bound, as
the averagers mirror them (`localsgd.averaging.flat`): FSDP writes each reduce-scattered gradient
into a DTensor of its own, which a view of our buffer cannot replace. Inside a replica group FSDP
has averaged the gradient already; the all-reduce over the replicate group then averages the
groups' local shards, so the step is HSDP's: the gradient of the mean loss over every rank.

With `aggregate` (a `robust.Aggregate`, any rule of `robust.RULES`) every step's gradients are
all-gathered instead and combined by the rule, NaN/Inf ones dropped (their ranks appended to
`comm.dropped`), as a `TrustedRound` without a judge does for the local phase's changes:
the warmup of post-local SGD over workers you cannot trust is Byzantine-robust mini-batch SGD.
It costs an all-gather of every worker's gradients a step (the all-reduce moves about 2x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import averaged_tensors, holds_dtensor, local_tensor, shard_group_of
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import TrustedRound


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
        # False, as DDP: an overflowed gradient is fp16 loss scaling's signal, and every rank
        # must see it to skip the step together (`localsgd.averaging.finite` would drop it)
        drop_nonfinite: bool = False,
        aggregate: Aggregate | None = None,
    ):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.comm = Communicator(process_group, stats, link, guard=drop_nonfinite)
        if init_sync:
            for tensor in averaged_tensors(module):
                self.comm.broadcast_(tensor.data, src=0)
        self.stats = self.comm.stats
        # DTensor parameters (FSDP2's shards): copies of the local gradient shards, see above
        self.mirror = holds_dtensor(self.params)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in self.params:
            local = local_tensor(p)
            groups.setdefault((local.device, local.dtype), []).append(p)
        self.buffers: list[torch.Tensor] = []
        self.bindings: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for (device, dtype), members in groups.items():
            shapes = [local_tensor(p).shape for p in members]
            flat = torch.zeros(sum(s.numel() for s in shapes), device=device, dtype=dtype)
            offset = 0
            for p, shape in zip(members, shapes, strict=True):
                view = flat[offset : offset + shape.numel()].view(shape)
                if not self.mirror:
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
                self.bindings.append((p, view))
                offset += shape.numel()
            self.buffers.append(flat)
        # a robust rule over the gathered gradients (see the module doc); None: the mean
        self.trust = (
            TrustedRound(self.buffers, self.comm.size, [None] * len(self.buffers), aggregate,
                         shards=shard_group_of(self.params) if self.mirror else None)
            if aggregate is not None
            else None
        )  # fmt: skip
        self._release()

    def _release(self) -> None:
        """Mirror: free the buffers' storage between all-reduces (the gradients hold the
        values), as the averagers' mirror does: no second copy of the gradient shards is kept
        across steps, nor for the rest of the run once the warmup is over."""
        if self.mirror:
            for flat in self.buffers:
                flat.untyped_storage().resize_(0)

    def _rebind(self) -> None:
        for p, view in self.bindings:
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    @torch.no_grad()  # in-place on a DTensor gradient's local shard
    def _pull(self) -> None:
        """Mirror: (re)allocate the buffers, copy the local gradient shards in (zeros for a
        parameter without one)."""
        for flat in self.buffers:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        for p, view in self.bindings:
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(p.grad))

    @torch.no_grad()
    def _push(self) -> None:
        """Mirror: write the averaged shards back into the gradients (a parameter that had
        none gets one, so that every group steps the same parameters)."""
        for p, view in self.bindings:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(view)
        self._release()

    def all_reduce(self) -> None:
        """Replace every gradient by its mean over the group; one communication round."""
        if self.mirror:
            self._pull()
        else:
            self._rebind()
        if self.trust is not None:
            seen = len(self.trust.events)
            # (anchors: unused without a judge)
            self.trust.run_(self.buffers, self.buffers, self.comm, [None] * len(self.buffers),
                            self.trust.rounds)  # fmt: skip
            self.comm.dropped += [e["rank"] for e in self.trust.events[seen:]]
        else:
            for flat in self.buffers:
                self.comm.mean_(flat)
        if self.mirror:
            self._push()
        self.stats.rounds += 1

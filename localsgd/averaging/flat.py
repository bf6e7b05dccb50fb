"""Persistent flat buffers: tensors rebound as views into one contiguous buffer per device/dtype.

Averaging then costs one in-place collective per buffer and allocates nothing, where torch's
`average_parameters` concatenates a fresh model-sized tensor and rebinds every `p.data` per call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class FlatBuffers:
    """Rebinds each tensor's `.data` to a slice of a flat buffer; the tensor objects stay the same.

    Optimizers, modules and user references keep working because a Parameter's identity does not
    change, only its storage. Tensors are grouped per (device, dtype) in the order given.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = _unique(tensors)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in self.tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        self.groups = list(groups.values())
        self.buffers: list[torch.Tensor] = []
        for members in self.groups:
            device, dtype = members[0].device, members[0].dtype
            flat = torch.empty(sum(t.numel() for t in members), device=device, dtype=dtype)
            offset = 0
            for t in members:
                view = flat[offset : offset + t.numel()].view(t.shape)
                view.copy_(t.detach())
                t.data = view
                offset += t.numel()
            self.buffers.append(flat)

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def is_bound(self) -> bool:
        """True while every tensor still lives in its buffer (`p.data = x` would unbind one)."""
        for flat, members in zip(self.buffers, self.groups, strict=True):
            offset = 0
            for t in members:
                if t.data_ptr() != flat[offset:].data_ptr():
                    return False
                offset += t.numel()
        return True


def averaged_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What a model average covers: every parameter and every floating-point buffer (BatchNorm's
    running statistics); integer buffers such as `num_batches_tracked` are left local."""
    params = list(module.parameters())
    buffers = [b for b in module.buffers() if torch.is_floating_point(b)]
    return params + buffers

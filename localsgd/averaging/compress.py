"""Compressed averaging: communicate a low-precision copy, keep master parameters in fp32.

Rounding the parameters themselves to bf16 at every sync would throw away every local update
smaller than bf16's resolution (about 0.4% of the weight), so late, small-LR training would stall.
Instead each sync communicates the *change* since the last sync, `x - anchor`, which is small,
in the low precision; the result is `anchor + mean(change)`, added in fp32. All members of a
group hold the same anchor (the state right after their last common sync), so the result is the
same on every rank, bit for bit. The low-precision buffers are allocated once.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import Relayout
from localsgd.averaging.reduce import Reducer

COMM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def comm_dtype_of(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be one of {', '.join(COMM_DTYPES)}, got {value!r}")
    return COMM_DTYPES[value]


def wire_buffers(buffers: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Preallocated buffers that carry each flat buffer's communication in `dtype` (None: the
    buffer goes on the wire as it is)."""
    return [
        None if b.dtype == dtype else torch.empty(b.numel(), dtype=dtype, device=b.device)
        for b in buffers
    ]


class LowPrecisionMean(Reducer):
    """Averages flat buffers through low-precision copies of their change since the last sync.

    `levels` anchors are kept for hierarchical averaging: anchor `l` is the state right after the
    last sync at level `l` or wider, which is what every member of a level-`l` group shares.
    """

    def __init__(self, buffers: list[torch.Tensor], dtype: torch.dtype, levels: int = 1):
        self.dtype = dtype
        self.anchors = [[b.detach().clone() for b in buffers] for _ in range(levels)]
        self.low = wire_buffers(buffers, dtype)

    def reset(self, buffers: list[torch.Tensor]) -> None:
        for anchors in self.anchors:
            for anchor, flat in zip(anchors, buffers, strict=True):
                anchor.copy_(flat)

    def relayout(self, convert: Relayout) -> None:
        self.anchors = [convert(anchors) for anchors in self.anchors]
        self.low = wire_buffers(self.anchors[0], self.dtype)

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        for flat, anchor, low in zip(buffers, self.anchors[level], self.low, strict=True):
            flat.sub_(anchor)  # the change since this group's last sync: small, so bf16 suffices
            comm.mean_(flat, through=low)
            flat.add_(anchor)
        for anchors in self.anchors[: level + 1]:
            for anchor, flat in zip(anchors, buffers, strict=True):
                anchor.copy_(flat)

    def state_dict(self) -> dict:
        return {"anchors": [[a.clone() for a in anchors] for anchors in self.anchors]}

    def load_state_dict(self, state: dict) -> None:
        for anchors, saved in zip(self.anchors, state["anchors"], strict=True):
            for anchor, value in zip(anchors, saved, strict=True):
                anchor.copy_(value)

"""The wire stage: how a part's contribution goes out, and what error feedback keeps.

Each slice of a part is one *piece* on the wire, in `sync.comm_dtype`: as it is (fp32), through
a 16-bit copy, or as block-quantised or top-k messages (`localsgd.averaging.wire.quantize`,
`localsgd.averaging.wire.sparse`), which are all-gathered and decoded in rank order. With error
feedback each piece keeps a residual, what this worker wanted to send minus what its message
decodes to, added (times the decay) to its next contribution before encoding
(`compress.lossy_mean_`). The mean over the transport is one call, blocking or launched; a
robust combine gathers the pieces instead (`combine.Gathered`).
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator, PendingMean
from localsgd.averaging.rounds.part import Tensors
from localsgd.averaging.wire.compress import (
    MESSAGE_FORMATS,
    CommFormat,
    feed_back_,
    forget_nonfinite_,
    load_residuals,
    lossy_mean_,
    residual_buffers,
    wire_buffers,
)


def buckets(pieces: Tensors, bucket_bytes: int | None) -> Tensors:
    """`pieces` split into views of at most `bucket_bytes` each (None: as they are), so that the
    first transfers start while later buckets are still being scaled."""
    if bucket_bytes is None:
        return list(pieces)
    return [b for t in pieces for b in t.split(max(1, bucket_bytes // t.element_size()))]


class Wire:
    """The wire buffers and residuals of one part's pieces (`shapes`: tensors shaped as them).
    `bucket_bytes`: a launched fp32 mean goes out in buckets of that many bytes (None: one
    all-reduce a piece)."""

    def __init__(
        self,
        shapes: Tensors,
        fmt: CommFormat,
        error_feedback: bool = False,
        decay: float = 1.0,
        bucket_bytes: int | None = None,
    ):
        self.fmt, self.error_feedback, self.decay = fmt, error_feedback, decay
        self.bucket_bytes = bucket_bytes
        self.quantized = isinstance(fmt, MESSAGE_FORMATS)
        self.specs = [(t.numel(), t.dtype, t.device) for t in shapes]
        self.low = wire_buffers(shapes, fmt)
        self.residuals = residual_buffers(shapes, self.low, error_feedback)

    def mean_(self, pieces: Tensors, comm: Communicator) -> None:
        """Each piece replaced in place by its mean over `comm`'s group, blocking."""
        for piece, low, residual in zip(pieces, self.low, self.residuals, strict=True):
            lossy_mean_(piece, comm, low, residual, self.decay)

    def launch_mean(self, pieces: Tensors, comm: Communicator) -> PendingMean:
        """The same mean, launched: the handle to wait on before reading `pieces` (the same bits
        as `mean_`)."""
        lows, residuals = self.low, self.residuals
        for piece, residual in zip(pieces, residuals, strict=True):
            feed_back_(piece, residual, self.decay)
        if self.quantized:
            pending = comm.launch_quantized_mean_(pieces, lows, residuals)
        elif all(low is None for low in lows):
            return comm.launch_mean_(buckets(pieces, self.bucket_bytes))
        else:
            through = []
            for piece, low, residual in zip(pieces, lows, residuals, strict=True):
                if low is not None:
                    low.copy_(piece)
                    if residual is not None:
                        torch.sub(piece, low, out=residual)  # wanted - sent
                through.append(piece if low is None else low)
            pending = comm.launch_mean_(pieces, through=through)
        for residual in residuals:
            forget_nonfinite_(residual, comm)
        return pending

    def reset(self) -> None:
        for residual in self.residuals:
            if residual is not None:
                residual.zero_()

    def relayout(self, shapes: Tensors, convert_residuals=None) -> None:
        """The pieces were laid out anew (`shapes`); `convert_residuals` carries the old
        residuals over (None: they restart at zero)."""
        old = [
            r if r is not None else torch.zeros(n, dtype=dtype, device=device)
            for r, (n, dtype, device) in zip(self.residuals, self.specs, strict=True)
        ]
        self.specs = [(t.numel(), t.dtype, t.device) for t in shapes]
        self.low = wire_buffers(shapes, self.fmt)
        self.residuals = residual_buffers(shapes, self.low, self.error_feedback)
        if self.error_feedback and convert_residuals is not None:
            load_residuals(self.residuals, convert_residuals(old))

    def state_dict(self) -> list:
        return [r.clone() if r is not None else None for r in self.residuals]

    def load_state_dict(self, saved: list | None) -> None:
        load_residuals(self.residuals, saved)

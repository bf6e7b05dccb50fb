"""Compressed averaging: communicate a low-precision copy, keep master parameters in fp32.

Rounding the parameters themselves to bf16 at every sync would throw away every local update
smaller than bf16's resolution (about 0.4% of the weight), so late, small-LR training would stall.
Instead each sync communicates the *change* since the last sync, `x - anchor`, which is small,
in the low precision; the result is `anchor + mean(change)`, added in fp32. All members of a
group hold the same anchor (the state right after their last common sync), so the result is the
same on every rank, bit for bit. The low-precision buffers are allocated once.

Below 16 bits (`int8`, `float8_e4m3fn`, `int4`, `float4_e2m1`: `localsgd.averaging.wire.quantize`)
each value is sent as a code with one fp32 scale per block of values; the messages are
all-gathered and every rank decodes and averages them in fp32 in rank order
(`Communicator.quantized_mean_`), again the same bits on every rank.

Error feedback (`error_feedback=True`; Seide et al. 2014, used by DeMo, MuLoCo, SparseLoCo):
each worker keeps a residual, what it wanted to send minus what its message decodes to, and adds
it to its next change before sending it, so rounding errors are delayed, never lost: the sum of
what a worker sent plus its residual is the sum of its true changes. Without it a change that is
always below a block's resolution (a slow coordinate beside a fast one) is never sent at all. The
residual is per worker and is checkpointed (`state_dict`). `feedback_decay` = beta < 1 decays it
first, `e <- beta e + change` (SparseLoCo's accumulator; the delayed errors then fade instead of
all arriving), 1 (the default) keeps every error.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.finite import all_finite
from localsgd.averaging.wire.quantize import (
    DEFAULT_BLOCK_SIZE,
    QUANTIZED_FORMATS,
    BlockCodec,
    QuantizedWire,
)
from localsgd.averaging.wire.sparse import SparseWire, TopKCodec

COMM_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # block-quantised, with the default block size (`comm_dtype_of` takes another)
    **{name: BlockCodec(name) for name in QUANTIZED_FORMATS},
}

# What `comm_dtype_of` returns: a dtype to cast to, a block-quantised format, or chunked top-k
# (`localsgd.averaging.wire.sparse`). The last two are exchanged as messages (all-gathered, decoded
# in rank order): `MESSAGE_FORMATS`, each with its wire (`MESSAGE_WIRES`).
CommFormat = torch.dtype | BlockCodec | TopKCodec
MESSAGE_FORMATS = (BlockCodec, TopKCodec)
MESSAGE_WIRES = (QuantizedWire, SparseWire)


def comm_dtype_of(
    value: str | torch.dtype | BlockCodec, block_size: int = DEFAULT_BLOCK_SIZE
) -> CommFormat:
    """The communication format named `value`: a torch dtype for float32/bfloat16/float16, a
    `BlockCodec` with `block_size` values per scale for int8/float8_e4m3fn/int4/float4_e2m1."""
    if isinstance(value, torch.dtype | BlockCodec | TopKCodec):
        return value
    if value not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be one of {', '.join(COMM_DTYPES)}, got {value!r}")
    if value in QUANTIZED_FORMATS:
        return BlockCodec(value, block_size)
    return COMM_DTYPES[value]


def wire_buffers(buffers: list[torch.Tensor], dtype: CommFormat) -> list:
    """Preallocated buffers that carry each flat buffer's communication in `dtype`: a tensor of
    that dtype, a `QuantizedWire` for a block-quantised format, a `SparseWire` for top-k, or
    None (the buffer goes on the wire as it is)."""
    if isinstance(dtype, BlockCodec):
        return [QuantizedWire(dtype, b.numel(), b.device) for b in buffers]
    if isinstance(dtype, TopKCodec):
        return [dtype.wire(b.numel(), b.device) for b in buffers]
    return [
        None if b.dtype == dtype else torch.empty(b.numel(), dtype=dtype, device=b.device)
        for b in buffers
    ]


def residual_buffers(buffers: list[torch.Tensor], low: list, error_feedback: bool) -> list:
    """Error feedback's residual per flat buffer (zeros), None where nothing is lost (no error
    feedback, or the buffer is sent as it is)."""
    return [
        torch.zeros_like(b) if error_feedback and w is not None else None
        for b, w in zip(buffers, low, strict=True)
    ]


def feed_back_(flat: torch.Tensor, residual: torch.Tensor | None, decay: float = 1.0) -> None:
    """`flat += decay * residual`: error feedback's carry (nothing without a residual)."""
    if residual is None:
        return
    if decay == 1.0:
        flat.add_(residual)
    else:
        flat.add_(residual, alpha=decay)


def lossy_mean_(
    flat: torch.Tensor, comm: Communicator, low, residual: torch.Tensor | None, decay: float = 1.0
) -> None:
    """`flat` (plus `decay` times `residual`, with error feedback) replaced by its mean over
    `comm`'s group, sent through `low` (see `wire_buffers`); `residual` then holds what this
    rank failed to send."""
    feed_back_(flat, residual, decay)
    if isinstance(low, MESSAGE_WIRES):
        comm.quantized_mean_(flat, low, residual)
    else:
        if residual is not None:
            low.copy_(flat)
            torch.sub(flat, low, out=residual)  # wanted - sent
        comm.mean_(flat, through=low)
    forget_nonfinite_(residual, comm)


def forget_nonfinite_(residual: torch.Tensor | None, comm: Communicator) -> None:
    """A contribution that held NaN/Inf was dropped from the round; its residual would carry
    the NaN into every later one, and is zeroed (with `comm.guard`)."""
    if residual is not None and comm.guard and not all_finite([residual]):
        residual.zero_()


def load_residuals(residuals: list, saved: list | None) -> None:
    """Restore the residuals (zeros where the checkpoint has none, e.g. taken without error
    feedback)."""
    for i, residual in enumerate(residuals):
        if residual is None:
            continue
        value = saved[i] if saved is not None and i < len(saved) else None
        if value is None:
            residual.zero_()
        else:
            residual.copy_(value)

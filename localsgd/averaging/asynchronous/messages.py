"""A contribution on its way to the syncer, in the run's wire format (`sync.comm_dtype`,
`sync.compress`): the same encodings and error feedback as a synchronous round's wire
(`localsgd.averaging.rounds.wire`), point-to-point instead of gathered.

The worker adds its residual (times the decay) to each piece, encodes it (a 16-bit copy, a
block-quantised or a top-k message), keeps what the message fails to carry as its next residual
(zeroed where the piece was not finite: that contribution is dropped anyway), and sends the
message; the syncer decodes it to fp32 with decoders of its own. An fp32 piece goes as it is.

A header's kinds: a worker *sends* (its phase ended), *meets* (a checkpoint or the end),
*announces* its next send time, or is *done*.
"""

from __future__ import annotations

import torch

from localsgd.averaging.rounds.part import Part, Tensors, views
from localsgd.averaging.wire.compress import MESSAGE_WIRES, CommFormat, feed_back_, wire_buffers
from localsgd.averaging.wire.sparse import SparseWire, TopKCodec

SEND, MEET, ANNOUNCE, DONE = "send", "meet", "announce", "done"


def encode_(
    pieces: Tensors, wire, sent: list | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The messages for `pieces` through `wire` (a `rounds.wire.Wire`: its buffers and
    residuals), and what each decodes to (`pieces` take the residual; they are the worker's
    work buffers, overwritten by the answer next). `sent` (a list): gets each piece's senders'
    marks (`sent_marks`)."""
    messages, decoded = [], []
    for piece, low, residual in zip(pieces, wire.low, wire.residuals, strict=True):
        feed_back_(piece, residual, wire.decay)
        if low is None:
            messages.append(piece)
            decoded.append(piece)
            if sent is not None:
                sent.append(None)
            continue
        if isinstance(low, MESSAGE_WIRES):
            low.encode_(piece)
            message, values = low.send, low.decode(low.send)
        else:
            low.copy_(piece)
            message, values = low, low
        if sent is not None:
            sent.append(sent_marks(low, piece.numel()))
        if residual is not None:
            torch.sub(piece, values, out=residual)  # wanted - sent
            if not torch.isfinite(residual).all():
                residual.zero_()
        messages.append(message)
        decoded.append(values)
    return messages, decoded


def counts_senders(fmt: CommFormat) -> bool:
    """Whether a merge divides each index by the contributions that sent it (top-k,
    `sync.topk_mean=senders`), so that each contribution carries its marks."""
    return isinstance(fmt, TopKCodec) and fmt.mean == "senders"


def sent_marks(low, numel: int) -> torch.Tensor | None:
    """Where the top-k message `low` (a piece's wire) last encoded or decoded holds an index
    (bool, `numel`); None for a wire that sends every value."""
    if not isinstance(low, SparseWire) or low.senders is None:
        return None
    marks = torch.zeros(low.chunks * low.codec.chunk, dtype=torch.bool, device=low.work.device)
    low.mark_sent_(marks)
    return marks[:numel]


class Decoders:
    """The syncer's side: an empty message per piece to receive into, and its fp32 values."""

    def __init__(self, shapes: Tensors, fmt: CommFormat):
        self.shapes = [(t.numel(), t.dtype) for t in shapes]
        self.wires = wire_buffers([t.detach().cpu() for t in shapes], fmt)
        self.senders = counts_senders(fmt)  # each message's marks go with its values

    def empty(self) -> list[torch.Tensor]:
        out = []
        for (numel, dtype), low in zip(self.shapes, self.wires, strict=True):
            if low is None:
                out.append(torch.empty(numel, dtype=dtype))
            elif isinstance(low, MESSAGE_WIRES):
                out.append(torch.empty(low.nbytes, dtype=torch.uint8))
            else:
                out.append(torch.empty(numel, dtype=low.dtype))
        return out

    def decode(self, messages: list[torch.Tensor], sent: list | None = None) -> list[torch.Tensor]:
        """The fp32 values of `messages`; `sent` (a list) gets each piece's senders' marks."""
        out = []
        for (numel, dtype), low, message in zip(self.shapes, self.wires, messages, strict=True):
            if isinstance(low, MESSAGE_WIRES):
                out.append(low.decode(message).to(dtype, copy=True))
            else:
                out.append(message.to(dtype))
            if sent is not None:
                sent.append(sent_marks(low, numel))
        return out


def part_decoders(buffers: Tensors, parts: list[Part], fmt: CommFormat) -> list[Decoders]:
    """One `Decoders` per part of `buffers` (the whole model, or each fragment)."""
    return [Decoders(views(buffers, part), fmt) for part in parts]

"""Chunked top-k with 2-bit values: the sparse pseudo-gradients of SparseLoCo (Sarfi et al. 2025).

A flat fp32 vector of `n` values is cut into chunks of `chunk` consecutive values (the last one
zero-padded). From each chunk the `k = max(1, round(density * chunk))` values of largest
magnitude are sent (`torch.topk` of the absolute values; ties go as torch breaks them), listed
by position, as

    what       per chunk                                           bits
    scale      fp32, the largest |value| sent                       32
    indices    Elias-Fano: the k positions, ascending, in           k l + k + (chunk >> l)
               l = max(0, floor(log2(chunk / k))) low bits each,
               and a bitmap of their high parts
    values     2-bit codes, four to a byte                          2 k

The indices are Elias-Fano coded at a fixed size per chunk: position `i_j` (the j-th smallest,
j = 0..k-1) sends its `l` low bits as they are, and sets bit `(i_j >> l) + j` of a bitmap of
`k + (chunk >> l)` bits; the decoder finds the k set bits `p_j` (exactly k per chunk) and gets
`i_j = ((p_j - j) << l) | low_j` (a message whose bitmaps do not hold k ones a chunk is
refused). About `2 + log2(chunk / k)` bits an index (8 at 64 of 4096) instead of int16's 16,
with nothing lost: the positions, and so the decoded values, are the same bits. The per-chunk
index bits of all chunks are packed back to back, least significant bit first, and the stream
is padded to a byte.

A code `c` in 0..3 decodes to `(2c - 3) / 3 * scale`: the four levels -1, -1/3, 1/3, 1 times
the scale, each value rounded to the nearest level (`|error| <= scale / 3` for the values
sent; the others are not sent at all). Every other position of the chunk decodes to zero.

One message is `[scales | indices | codes]`, uint8, `4 C + ceil(C b / 8) + ceil(C k / 4)`
bytes for `C = ceil(n / chunk)` chunks of `b = k l + k + (chunk >> l)` index bits: the default
chunk of 4096 at density 1/64 (k = 64, l = 6) is 4 + 64 + 16 = 84 bytes per 4096 values, 0.021
bytes per value, 195x less than fp32 (int16 indices made it 148 bytes before 2026-12-05). A
chunk of zeros has scale 0 and decodes to zeros.

The exchange is the block-quantised formats' (`localsgd.averaging.wire.quantize`): every rank
encodes its own message, the messages are all-gathered (`Communicator.quantized_mean_`), and
every rank decodes every rank's message and sums them in fp32 in rank order, so every rank gets
the same bits. The sum is divided by the number of workers (`mean="all"`, the mean of the
messages, zeros where a worker did not send), or, with `mean="senders"`, each index by the
number of workers whose message holds it (SparseLoCo's reference code, a `scatter_reduce` mean
over what was sent): an index that one worker of R sent then moves by its whole value, not
1/R of it. Each worker's sent + residual still sums to its true pseudo-gradients; what the
model moves by is then no longer their mean. Without error feedback the values not sent are
lost; with it (`compress`'s residual) each worker keeps them and adds them to its next
pseudo-gradient, which is what makes top-k work (a row of `localsgd.cli.refusals` requires it).
Pure torch: CPU and CUDA.
"""

from __future__ import annotations

import math

import torch

from localsgd.averaging.wire.quantize import GatheredWire

DEFAULT_CHUNK = 4096
DEFAULT_DENSITY = 1 / 64
# The wire has no limit of its own; this bound catches a mistyped `topk_chunk` (a chunk this
# large already shares one scale across whole layers) and is where the round trip is tested.
MAX_CHUNK = 1 << 20
MEANS = ("all", "senders")  # what the sum of the decoded messages is divided by (module doc)
_LEVELS = 3  # codes 0..3 sit at (2c - 3) / 3 of the scale


class TopKCodec:
    """Chunked top-k with 2-bit values and one fp32 scale per chunk (see the module doc).
    Stateless; the buffers live in `SparseWire`."""

    name = "topk"

    def __init__(
        self, density: float = DEFAULT_DENSITY, chunk: int = DEFAULT_CHUNK, mean: str = "all"
    ):
        if mean not in MEANS:
            raise ValueError(f"top-k mean must be one of {', '.join(MEANS)}, got {mean!r}")
        if not isinstance(chunk, int) or not 2 <= chunk <= MAX_CHUNK:
            raise ValueError(f"top-k chunk must be an integer in [2, {MAX_CHUNK}], got {chunk!r}")
        if not 0 < density <= 1:
            raise ValueError(f"top-k density must be in (0, 1], got {density!r}")
        self.density, self.chunk, self.mean = float(density), chunk, mean
        self.k = min(chunk, max(1, round(density * chunk)))
        # Elias-Fano: l = max(0, floor(log2(chunk / k))) low bits an index, sent as they are,
        # and a bitmap of k + (chunk >> l) bits for the high parts (module doc)
        self.low_bits = max(0, (chunk // self.k).bit_length() - 1)
        self.index_bits = self.k * self.low_bits + self.k + (chunk >> self.low_bits)

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density!r}, chunk={self.chunk}, mean={self.mean!r})"

    def __str__(self) -> str:
        return f"topk({self.k}/{self.chunk})" + (", senders' mean" if self.mean != "all" else "")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopKCodec):
            return NotImplemented
        return (self.k, self.chunk, self.mean) == (other.k, other.chunk, other.mean)

    def __hash__(self) -> int:
        return hash((self.k, self.chunk, self.mean))

    # --- sizes ---------------------------------------------------------------------------------

    def num_chunks(self, numel: int) -> int:
        return math.ceil(numel / self.chunk)

    def index_bytes(self, numel: int) -> int:
        """Bytes of the Elias-Fano coded indices of all chunks, packed back to back."""
        return math.ceil(self.num_chunks(numel) * self.index_bits / 8)

    def wire_bytes(self, numel: int) -> int:
        """Bytes one worker sends for `numel` values: scales, indices and codes."""
        chunks = self.num_chunks(numel)
        return 4 * chunks + self.index_bytes(numel) + math.ceil(chunks * self.k / 4)

    def wire(self, numel: int, device: torch.device | str) -> SparseWire:
        return SparseWire(self, numel, device)

    # --- allocating conveniences ---------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, `wire_bytes(x.numel())`) encoding `x`."""
        wire = SparseWire(self, x.numel(), x.device)
        wire.encode_(x.reshape(-1))
        return wire.send.clone()

    def dequantize(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        wire = SparseWire(self, numel, message.device)
        return wire.decode(message).clone()


class SparseWire(GatheredWire):
    """The preallocated buffers that send one flat buffer of `numel` values as top-k messages:
    `send`, a gather buffer per group size and the fp32 work space. The interface of
    `quantize.QuantizedWire`, so the wire stage (`rounds.wire.Wire`) and a gathered round
    (`robust.GatheredContributions`) exchange these as they exchange quantised messages, whatever
    the part, the transport (blocking, launched, torchft) or the outer step."""

    def __init__(self, codec: TopKCodec, numel: int, device: torch.device | str):
        self.codec, self.numel = codec, numel
        chunks, k, low = codec.num_chunks(numel), codec.k, codec.low_bits
        self.chunks, self.sent = chunks, chunks * k
        self.nbytes = codec.wire_bytes(numel)
        self.index_start = 4 * chunks
        self.code_start = self.index_start + codec.index_bytes(numel)
        self.work = torch.zeros(chunks * codec.chunk, dtype=torch.float32, device=device)
        self.magnitude = torch.empty_like(self.work)
        self.top = torch.empty(chunks, k, dtype=torch.float32, device=device)
        self.index = torch.empty(chunks, k, dtype=torch.int64, device=device)
        self.order = torch.empty_like(self.index)  # where the sort puts its permutation (not read)
        self.scales = torch.empty(chunks, dtype=torch.float32, device=device)
        self.codes = torch.zeros(math.ceil(self.sent / 4) * 4, dtype=torch.uint8, device=device)
        # the Elias-Fano index stream, one byte a bit: per chunk its k * low low bits, then its
        # bitmap; padded to whole bytes
        bits = chunks * codec.index_bits
        self.bits = torch.zeros(math.ceil(bits / 8) * 8, dtype=torch.uint8, device=device)
        per_chunk = self.bits[:bits].view(chunks, codec.index_bits)
        self.low_parts = per_chunk[:, : k * low].view(chunks, k, low)
        self.bitmap = per_chunk[:, k * low :]
        self.shifts = torch.arange(low, dtype=torch.int64, device=device)
        self.ranks = torch.arange(k, dtype=torch.int64, device=device)  # j of the j-th index
        # the chunk of each position a message holds, in order: what a valid bitmap's ones give
        self.chunk_of = torch.arange(chunks, device=device).repeat_interleave(k)
        self.send = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self._gathered: dict[int, torch.Tensor] = {}
        self.acc: torch.Tensor | None = None
        # mean="senders": per index, how many (or what weight of) the decoded messages sent it
        self.senders = torch.zeros_like(self.work) if codec.mean == "senders" else None

    def encode_(self, x: torch.Tensor) -> None:
        """Encode the flat tensor `x` (`numel` values, any float dtype) into `send`."""
        n, work, codec = self.numel, self.work, self.codec
        work[:n].copy_(x)
        work[n:].zero_()
        chunks = work.view(self.chunks, codec.chunk)
        torch.abs(work, out=self.magnitude)
        _, index = torch.topk(self.magnitude.view(self.chunks, codec.chunk), codec.k, dim=1)
        torch.sort(index, dim=1, out=(self.index, self.order))  # ascending, for Elias-Fano
        torch.gather(chunks, 1, self.index, out=self.top)
        scales = self.send[: self.index_start].view(torch.float32)
        torch.amax(self.top.abs(), dim=1, out=scales)  # NaN propagates
        divisor = self.scales.copy_(scales).masked_fill_(scales == 0, 1.0)
        # nearest of the levels (2c - 3) / 3: c = round((3 v / s + 3) / 2), in 0..3
        level = self.top.div_(divisor.unsqueeze(1)).mul_(1.5).add_(1.5).round_().clamp_(0, 3)
        self._encode_indices()
        self.codes[: self.sent].copy_(level.view(-1))
        self.codes[self.sent :].zero_()
        quads = self.codes.view(-1, 4)
        payload = self.send[self.code_start :]
        torch.mul(quads[:, 3], 64, out=payload)
        payload.add_(quads[:, 2] * 16).add_(quads[:, 1] * 4).add_(quads[:, 0])

    def _encode_indices(self) -> None:
        """`index` (ascending in each chunk) Elias-Fano coded into `send`'s index bytes."""
        low = self.codec.low_bits
        self.low_parts.copy_(self.index.unsqueeze(2).bitwise_right_shift(self.shifts) & 1)
        self.bitmap.zero_()
        self.bitmap.scatter_(1, self.index.bitwise_right_shift(low).add_(self.ranks), 1)
        octets = self.bits.view(-1, 8)  # least significant bit first
        packed = self.send[self.index_start : self.code_start]
        packed.copy_(octets[:, 7]).bitwise_left_shift_(7)
        for j in range(6, -1, -1):
            packed.bitwise_or_(octets[:, j].bitwise_left_shift(j))

    def _decode_indices(self, packed: torch.Tensor) -> None:
        """`index` <- the positions the Elias-Fano bytes `packed` hold, ascending in each chunk."""
        octets = self.bits.view(-1, 8)
        for j in range(8):
            torch.bitwise_right_shift(packed, j, out=octets[:, j])
        self.bits.bitwise_and_(1)
        # the set bits of every chunk's bitmap, in order: exactly k a chunk in a message of this
        # wire (anything else would decode to positions outside the chunk, so it is refused)
        ones = self.bitmap.nonzero()
        if ones.shape[0] != self.sent or not torch.equal(ones[:, 0], self.chunk_of):
            raise ValueError(
                f"not a top-k message of this wire: its index bitmaps do not hold "
                f"{self.codec.k} positions in each of {self.chunks} chunks"
            )
        high = ones[:, 1].view(self.chunks, self.codec.k).sub_(self.ranks)
        low = (self.low_parts.long() << self.shifts).sum(2)
        torch.bitwise_or(high.bitwise_left_shift_(self.codec.low_bits), low, out=self.index)

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The fp32 values `message` (`nbytes` uint8, anywhere in memory) decodes to: a view of
        this wire's work space, overwritten by the next `encode_`/`decode`."""
        n, codec = self.numel, self.codec
        self.scales.view(torch.uint8).copy_(message[: self.index_start])
        self._decode_indices(message[self.index_start : self.code_start])
        payload = message[self.code_start :]
        quads = self.codes.view(-1, 4)
        for j in range(4):
            torch.bitwise_right_shift(payload, 2 * j, out=quads[:, j])
        self.codes.bitwise_and_(3)
        level = self.top.view(-1)
        level.copy_(self.codes[: self.sent]).mul_(2).sub_(_LEVELS).div_(_LEVELS)
        self.top.mul_(self.scales.unsqueeze(1))
        self.work.zero_()
        self.work.view(self.chunks, codec.chunk).scatter_(1, self.index, self.top)
        return self.work[:n]

    def count_senders_(self, first: bool, weight: float = 1.0) -> None:
        """mean="senders": add `weight` at every index the message last decoded holds (after
        zeroing the count when `first`)."""
        if first:
            self.senders.zero_()
        # top-k indices are distinct within a chunk, so scatter_add_ counts each once
        self.senders.view(self.chunks, self.codec.chunk).scatter_add_(
            1, self.index, self.top.new_full(self.top.shape, weight)
        )

    def mark_sent_(self, sent: torch.Tensor) -> None:
        """`sent` (bool, `chunks * chunk` values: the padded length) <- where the message last
        decoded holds an index; a gathered round's senders' mean (`robust.Aggregate.combine`)
        counts these."""
        sent.zero_()
        sent.view(self.chunks, self.codec.chunk).scatter_(1, self.index, True)

    def divide_by_senders_(self, acc: torch.Tensor) -> None:
        """`acc` (the sum of the decoded messages) divided, index by index, by how many of them
        sent it; an index none sent stays 0."""
        count = self.senders[: self.numel]
        acc.div_(count.masked_fill_(count == 0, 1.0))

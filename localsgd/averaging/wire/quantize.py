"""Block-wise quantisation below 16 bits: int8, float8 (e4m3fn) and two 4-bit formats.

A flat fp32 vector of `n` values is cut into blocks of `block_size` consecutive values (the last
one zero-padded). Each block is sent as one fp32 scale, `absmax(block) / qmax`, plus one code per
value, `value / scale` rounded to the format:

    name            code per value                      qmax   payload bytes
    int8            symmetric integer in [-127, 127]     127    n
    float8_e4m3fn   torch.float8_e4m3fn (round-to-even)  448    n
    int4            symmetric integer in [-7, 7]           7    ceil(n / 2)
    float4_e2m1     FP4 E2M1, +-{0, .5, 1, 1.5, 2, 3, 4, 6}  6    ceil(n / 2)

plus `4 * ceil(n / block_size)` bytes of fp32 scales. The 4-bit codes are packed two per byte,
value `2i` in the low nibble of byte `i`, value `2i + 1` in the high one. `int4` stores
`q + 8` (offset binary, 1..15); `float4_e2m1` stores the E2M1 bit pattern (bit 3 the sign, bits
0-2 the index into 0, .5, 1, 1.5, 2, 3, 4, 6): FP4 as the OCP microscaling formats define it.
Streaming DiLoCo (Douillard et al. 2025) sends 4-bit floats too; its exact layout is not claimed
here (E2M1 is the standard FP4, not a reproduction of the paper's). With the default block of
128 values a 4-bit message is 0.53125 bytes per value, 0.133x fp32; int8 and float8 are 1.03125
bytes per value, 0.258x.

Error bounds per block (scale = absmax / qmax): int8 and int4 round to the nearest multiple of
the scale, `|error| <= scale / 2`; float8_e4m3fn keeps 3 mantissa bits, `|error| <=
max(|x| / 16, scale * 2**-10)`; float4_e2m1 `|error| <= max(|x| / 4, scale / 4)`. The fp32
scale keeps every magnitude a float32 can hold; a block of zeros has scale 0 and decodes to
zeros; a non-finite value makes its block decode to non-finite values (nothing is silently
clipped to a finite number).

One message is `[scales as bytes | payload]`, a uint8 tensor, so exchanging it is one all-gather
of bytes (integers cannot be summed in a reduction without overflow); every rank then decodes
every rank's message and averages in fp32 in rank order (`Communicator.quantized_mean_`), so all
ranks get the same bits. Pure torch: CPU and CUDA, no Triton. `QuantizedWire` holds the buffers
for one flat buffer, allocated once.
"""

from __future__ import annotations

import math

import torch

DEFAULT_BLOCK_SIZE = 128
QUANTIZED_FORMATS = ("int8", "float8_e4m3fn", "int4", "float4_e2m1")

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "int4": 7.0, "float4_e2m1": 6.0}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of E2M1 codes 0..7


def _e2m1_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(midpoints between the 15 sorted signed values, the E2M1 nibble of each sorted value,
    the value of each of the 16 nibbles)."""
    signed = [-m for m in reversed(_E2M1[1:])] + list(_E2M1)  # -6 .. 6, 15 values
    mids = torch.tensor([(a + b) / 2 for a, b in zip(signed, signed[1:], strict=False)])
    nibble = torch.tensor([8 | (7 - k) if k < 7 else k - 7 for k in range(15)], dtype=torch.uint8)
    values = torch.tensor(list(_E2M1) + [-m for m in _E2M1])
    return mids, nibble, values


class BlockCodec:
    """One quantised format with per-block fp32 scales (see the module doc). Stateless: the
    buffers live in `QuantizedWire`; `quantize`/`dequantize` are allocating conveniences."""

    scale_bytes_each = 4  # fp32 scales

    def __init__(self, name: str, block_size: int = DEFAULT_BLOCK_SIZE):
        if name not in QUANTIZED_FORMATS:
            raise ValueError(
                f"quantised format must be one of {', '.join(QUANTIZED_FORMATS)}, got {name!r}"
            )
        if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
            raise ValueError(f"quantisation block size must be an even integer >= 2, got "
                             f"{block_size!r}")  # fmt: skip
        self.name = name
        self.block_size = block_size
        self.bits = 4 if name in ("int4", "float4_e2m1") else 8
        self.qmax = _QMAX[name]

    def __repr__(self) -> str:
        return f"BlockCodec({self.name!r}, block_size={self.block_size})"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockCodec):
            return NotImplemented
        return (self.name, self.block_size) == (other.name, other.block_size)

    def __hash__(self) -> int:
        return hash((self.name, self.block_size))

    # --- sizes ---------------------------------------------------------------------------------

    def num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the codes of `numel` values."""
        return numel if self.bits == 8 else math.ceil(numel / 2)

    def scale_bytes(self, numel: int) -> int:
        return self.scale_bytes_each * self.num_blocks(numel)

    def wire_bytes(self, numel: int) -> int:
        """Bytes one worker sends for `numel` values: payload plus scales."""
        return self.payload_bytes(numel) + self.scale_bytes(numel)

    # --- allocating conveniences ---------------------------------------------------------------

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, `wire_bytes(x.numel())`) encoding `x`."""
        wire = QuantizedWire(self, x.numel(), x.device)
        wire.encode_(x.reshape(-1))
        return wire.send.clone()

    def dequantize(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values (`numel`) a message decodes to."""
        wire = QuantizedWire(self, numel, message.device)
        return wire.decode(message).clone()


class GatheredWire:
    """What a wire whose messages are all-gathered holds besides its codec's arrays: the
    gather buffers (one per group size), the fp32 sum for buffers of another dtype. A subclass
    sets `send` (this rank's message), `nbytes`, `numel`, `_gathered = {}` and `acc = None`."""

    send: torch.Tensor
    nbytes: int
    numel: int
    _gathered: dict[int, torch.Tensor]
    acc: torch.Tensor | None

    def gathered(self, size: int) -> torch.Tensor:
        """The buffer a group of `size` ranks gathers its messages into (one per size)."""
        if size not in self._gathered:
            self._gathered[size] = torch.empty(
                size * self.nbytes, dtype=torch.uint8, device=self.send.device
            )
        return self._gathered[size]

    def accumulator(self, flat: torch.Tensor) -> torch.Tensor:
        """Where the fp32 average of `flat` is summed: `flat` itself when it is fp32."""
        if flat.dtype == torch.float32:
            return flat
        if self.acc is None:
            self.acc = torch.empty(self.numel, dtype=torch.float32, device=flat.device)
        return self.acc


class QuantizedWire(GatheredWire):
    """The preallocated buffers that send one flat buffer of `numel` values in `codec`'s format:
    `send` (this rank's message), a gather buffer per group size, and the fp32 work space."""

    def __init__(self, codec: BlockCodec, numel: int, device: torch.device | str):
        self.codec, self.numel = codec, numel
        self.nblocks = codec.num_blocks(numel)
        self.nbytes = codec.wire_bytes(numel)
        self.scale_end = codec.scale_bytes(numel)
        padded = self.nblocks * codec.block_size
        self.work = torch.zeros(padded, dtype=torch.float32, device=device)
        self.lo = torch.empty(self.nblocks, dtype=torch.float32, device=device)
        self.hi = torch.empty(self.nblocks, dtype=torch.float32, device=device)
        self.scales = torch.empty(self.nblocks, dtype=torch.float32, device=device)  # aligned
        self.send = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.codes = (
            torch.zeros(padded, dtype=torch.uint8, device=device) if codec.bits == 4 else None
        )
        self.index = None
        if codec.name == "float4_e2m1":
            mids, nibble, values = _e2m1_tables()
            self.mids, self.nibble, self.values = (
                mids.to(device),
                nibble.to(device),
                values.to(device),
            )
            self.index = torch.zeros(padded, dtype=torch.int32, device=device)
        self._gathered: dict[int, torch.Tensor] = {}
        self.acc: torch.Tensor | None = None  # fp32 sum for buffers of another dtype

    def encode_(self, x: torch.Tensor) -> None:
        """Quantise the flat tensor `x` (`numel` values, any float dtype) into `send`."""
        n, work, codec = self.numel, self.work, self.codec
        work[:n].copy_(x)
        work[n:].zero_()
        blocks = work.view(self.nblocks, codec.block_size)
        torch.aminmax(blocks, dim=1, out=(self.lo, self.hi))
        torch.maximum(self.lo.neg_(), self.hi, out=self.hi)  # absmax (NaN propagates)
        scales = self.send[: self.scale_end].view(torch.float32)  # offset 0: aligned
        torch.div(self.hi, codec.qmax, out=scales)
        divisor = self.lo.copy_(scales).masked_fill_(scales == 0, 1.0)  # zeros stay zeros
        blocks.div_(divisor.unsqueeze(1))
        payload = self.send[self.scale_end :]
        if codec.name == "int8":
            work.round_().clamp_(-codec.qmax, codec.qmax)
            payload.view(torch.int8).copy_(work[:n])
        elif codec.name == "float8_e4m3fn":
            work.clamp_(-codec.qmax, codec.qmax)
            payload.view(torch.float8_e4m3fn).copy_(work[:n])
        else:
            if codec.name == "int4":
                work.round_().clamp_(-codec.qmax, codec.qmax).add_(8)
                self.codes.copy_(work)
            else:
                torch.bucketize(work, self.mids, out_int32=True, out=self.index)
                torch.index_select(self.nibble, 0, self.index, out=self.codes)
            pairs = self.codes.view(-1, 2)[: payload.numel()]
            torch.mul(pairs[:, 1], 16, out=payload)  # high nibble; 15 * 16 + 15 fits a byte
            payload.add_(pairs[:, 0])

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The fp32 values `message` (`nbytes` uint8, anywhere in memory) decodes to: a view of
        this wire's work space, overwritten by the next `encode_`/`decode`."""
        n, work, codec = self.numel, self.work, self.codec
        self.scales.view(torch.uint8).copy_(message[: self.scale_end])
        payload = message[self.scale_end :]
        if codec.name == "int8":
            work[:n].copy_(payload.view(torch.int8))
        elif codec.name == "float8_e4m3fn":
            work[:n].copy_(payload.view(torch.float8_e4m3fn))
        else:
            pairs = self.codes.view(-1, 2)[: payload.numel()]
            torch.bitwise_and(payload, 15, out=pairs[:, 0])
            torch.bitwise_right_shift(payload, 4, out=pairs[:, 1])
            if codec.name == "int4":
                work.copy_(self.codes).sub_(8)
            else:
                self.index.copy_(self.codes)
                torch.index_select(self.values, 0, self.index, out=work)
        work.view(self.nblocks, codec.block_size).mul_(self.scales.unsqueeze(1))
        return work[:n]

"""No poisoned average: a contribution holding NaN or Inf is dropped from its all-reduce.

An all-reduced mean cannot drop anything once the reduction has run: one NaN makes every
replica NaN. Gathering every contribution first would let each rank check them all, at `size`
times the bytes. This guard costs nothing on the wire in a clean round:

1. before the reduction, each rank checks its own contribution, in the pass that scales it
   (`checked_scale_`: torch's fused check-and-scale kernel, one read and one write): a weighted
   round's share, or the division by the group's size. Where the backend averages inside the
   reduction (gloo from torch 2.13, NCCL), a guarded mean divides first and sums instead, where
   that division is one exact multiplication (`fuses_division`: float32 on the CPU, the size a
   power of two), so the check rides the division the backend would have made; elsewhere the
   backend averages and the check is one sum over the contribution, no copy (`all_finite`).
   A rank whose contribution is not finite sends zeros instead, with +Inf in one *canary*
   place (the first value of each buffer); every rank keeps its own first values;
2. the reduction runs (the same bytes as unguarded, and the same bits when every contribution
   is finite, but at float32's edges where the guard divides first: below);
3. every rank reads the reduced canaries, which are the same on every rank. All finite: done.
   Not finite (a rank was dropped, or the finite values themselves overflowed there): one more
   all-reduce of `size + 1 + buffers` float64 slots carries which ranks were finite, the sum of
   their weights and their kept first values, and every rank rescales the mean of the finite
   contributions from that, the same operations on the same bits everywhere.

The check must finish before any byte leaves: once a value has been summed in place it cannot be
taken out again to the bit, so splitting the buffer to check one chunk while the previous one is
on the wire would change a poisoned round's mean.

Dividing first gives the bits of the backend's AVG: gloo's AVG sums in its ring order then
divides (measured: the same bits as SUM then `div_`, 2 to 4 processes), and dividing by a power
of two is exact, so each partial sum is the AVG's partial sum divided by the size, rounded the
same way. Exact except at float32's edges, where the division is not exact: where a
contribution, a partial sum or the mean is nonzero and below `size` x float32's smallest normal
number (1.2e-38) in magnitude, the two may round differently (measured at most 1.5e-42 apart,
2 and 4 processes); where the sum overflows float32 but the mean does not, AVG gives +-Inf and
this the finite mean. Every rank still gets the same bits (one SUM all-reduce). Sizes that are
not a power of two keep the backend's AVG and the separate summing pass (a division by 3 first
rounds differently from AVG's: measured on about half the values), as do other dtypes and devices,
and builds without the fused kernel. The guard's cost against gloo's AVG is measured in
`experiments/bench/nonfinite_guard.py` (docs/performance.md).

The dropped ranks are appended to `Communicator.dropped` (the averager names them in its
events). If no contribution is finite the average cannot be formed: every rank raises the same
error. A rank cannot tell a bad contribution from one that carries its own canary as +Inf, and
does not need to: both are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

_CHUNK = 1 << 20  # the exact check's flags, a chunk at a time: 1 MiB

# torch's fused kernel behind `GradScaler.unscale_`: multiplies each tensor in place by a scale
# and sets a flag where an input value is NaN/Inf, in one pass (absent from some builds)
_CHECK_AND_SCALE = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite. One sum per tensor: a NaN or an Inf makes
    the sum non-finite, in any order of addition, so a finite sum settles it; `torch.isfinite`
    element by element allocates flags and costs several passes (measured: about 15x the sum
    on a 10M-value CPU buffer). A sum that is not finite (a bad value, or finite values that
    overflowed it) is settled by the exact check, a chunk at a time."""
    for t in tensors:
        if not t.numel() or math.isfinite(t.sum().item()):
            continue
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), _CHUNK):
            if not bool(torch.isfinite(flat[i : i + _CHUNK]).all()):
                return False
    return True


def scale_(tensors: Sequence[torch.Tensor], multiply: float | None, divide: int | None) -> None:
    """What a round does to a contribution before a SUM all-reduce: multiply it by `multiply`
    (a weighted round's share) or divide it by `divide` (the group's size, where the backend
    cannot average); neither: nothing."""
    for t in tensors:
        if multiply is not None:
            t.mul_(multiply)
        elif divide is not None:
            t.div_(divide)


def _fused_factor(
    tensors: Sequence[torch.Tensor], multiply: float | None, divide: int | None
) -> float | None:
    """The factor the fused kernel multiplies by to give `scale_`'s bits, or None where it
    cannot. Its factor is a float32, which a float32 tensor's `mul_` uses too (tested bit for
    bit); dividing by a power of two is multiplying by its exact inverse (the same real result,
    rounded once either way), any other division is not. Only float32 on the CPU, where it is
    tested: its half-precision CPU path is slower than a sum (measured 22 ms vs 1.2 ms on 10M
    bfloat16 values), and a float64 tensor's `mul_` would not round the factor to float32."""
    if _CHECK_AND_SCALE is None or not tensors:
        return None
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return None
    if multiply is not None:
        return float(multiply)
    if divide is not None and divide > 0 and divide & (divide - 1) == 0:
        return 1.0 / divide
    return None


def fuses_division(tensors: Sequence[torch.Tensor], size: int) -> bool:
    """Whether a guarded mean of `tensors` over `size` ranks divides them by `size` in the
    pass that checks them and sums them, instead of the backend's AVG (see the module doc):
    where the fused kernel gives `div_`'s bits (`_fused_factor`)."""
    return _fused_factor(tensors, None, size) is not None


def checked_scale_(
    tensors: Sequence[torch.Tensor], multiply: float | None = None, divide: int | None = None
) -> bool:
    """`scale_`, returning whether every value was finite before it: one pass where the fused
    kernel gives the same bits (`_fused_factor`), else `all_finite` then `scale_`."""
    factor = _fused_factor(tensors, multiply, divide)
    if factor is None:
        ok = all_finite(tensors)
        scale_(tensors, multiply, divide)
        return ok
    found = torch.zeros(1)
    _CHECK_AND_SCALE(list(tensors), found, torch.full((1,), factor))
    return found.item() == 0.0


def _firsts(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Each tensor's first value (exact in a Python float): one host read a tensor on the CPU,
    one for them all elsewhere."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.reshape(-1)[0].item() for t in tensors]
    return torch.stack([t.reshape(-1)[0] for t in tensors]).double().tolist()


class NonFiniteGuard:
    """One guarded reduction of `wires` (one all-reduce each, or one launched set): arm them
    before the reduction, `settle` them after (see the module doc). `multiply` / `divide`: the
    round's scaling of each wire (`scale_`), done here in the pass that checks them."""

    def __init__(
        self,
        wires: Sequence[torch.Tensor],
        multiply: float | None = None,
        divide: int | None = None,
    ):
        self.wires = [w for w in wires if w.numel()]
        self.first = _firsts(self.wires) if self.wires else []  # before the scaling
        self.ok = checked_scale_(self.wires, multiply, divide)
        # one host read a round (as the reduced canary's, after): a clean round writes nothing
        if not self.ok:
            for w in self.wires:
                w.zero_()
                w.reshape(-1)[0] = math.inf

    def settle(
        self,
        scale: float,
        rank: int,
        size: int,
        all_reduce: Callable[[torch.Tensor], None],
    ) -> list[int]:
        """After the reduction: `scale` is what this rank's contribution was multiplied by
        (1/size for the mean, its share in a weighted round), `all_reduce` sums a float64
        tensor over the group (and counts it). Returns the ranks dropped (none in a clean
        round, with no communication)."""
        if not self.wires:
            return []
        if all(math.isfinite(v) for v in _firsts(self.wires)):
            return []
        device = self.wires[0].device
        slots = torch.zeros(size + 1 + len(self.wires), dtype=torch.float64, device=device)
        if self.ok:
            slots[rank] = 1.0
            slots[size] = scale
            slots[size + 1 :] = torch.tensor(self.first, dtype=torch.float64) * scale
        all_reduce(slots)
        finite = slots[:size].tolist()
        weight = float(slots[size])
        dropped = [r for r in range(size) if finite[r] == 0.0]
        if len(dropped) == size or weight == 0:
            raise RuntimeError(
                "every worker's contribution to this average held NaN or Inf, or weighed "
                "nothing: there is nothing finite to average (sync.drop_nonfinite)"
            )
        firsts = (slots[size + 1 :] / weight).tolist()
        for w, first in zip(self.wires, firsts, strict=True):
            w.mul_(1.0 / weight)
            w.reshape(-1)[0] = first
        return dropped

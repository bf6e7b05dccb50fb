"""No poisoned average: a contribution holding NaN or Inf is dropped from its all-reduce.

An all-reduced mean cannot drop anything once the reduction has run: one NaN makes every
replica NaN. Gathering every contribution first would let each rank check them all, at `size`
times the bytes. This guard costs nothing on the wire in a clean round:

1. before the reduction, each rank checks its own contribution (`all_finite`: one sum over it,
   no copy). A rank whose contribution is not finite sends zeros instead, with +Inf in one
   *canary* place (the first value of each buffer); every rank keeps its own first values;
2. the reduction runs as it always does (the same bytes, and the same bits when every
   contribution is finite);
3. every rank reads the reduced canaries, which are the same on every rank. All finite: done.
   Not finite (a rank was dropped, or the finite values themselves overflowed there): one more
   all-reduce of `size + 1 + buffers` float64 slots carries which ranks were finite, the sum of
   their weights and their kept first values, and every rank rescales the mean of the finite
   contributions from that, the same operations on the same bits everywhere.

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


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite. One sum per tensor: a NaN or an Inf makes
    the sum non-finite, in any order of addition, so a finite sum settles it; `torch.isfinite`
    element by element allocates flags and costs several passes (measured: about 15x the sum
    on a 10M-value CPU buffer). A sum that is not finite (a bad value, or finite values that
    overflowed it) is settled by the exact check, a chunk at a time."""
    for t in tensors:
        if not t.numel() or bool(torch.isfinite(t.sum())):
            continue
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), _CHUNK):
            if not bool(torch.isfinite(flat[i : i + _CHUNK]).all()):
                return False
    return True


class NonFiniteGuard:
    """One guarded reduction of `wires` (one all-reduce each, or one launched set): arm them
    before the reduction, `settle` them after (see the module doc)."""

    def __init__(self, wires: Sequence[torch.Tensor]):
        self.wires = [w for w in wires if w.numel()]
        self.ok = all_finite(self.wires)
        self.first = (
            torch.stack([w.reshape(-1)[0] for w in self.wires]).double()
            if self.wires
            else None
        )
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
        reduced = torch.stack([w.reshape(-1)[0] for w in self.wires])
        if bool(torch.isfinite(reduced).all()):
            return []
        slots = torch.zeros(size + 1 + len(self.wires), dtype=torch.float64,
                            device=self.first.device)  # fmt: skip
        if self.ok:
            slots[rank] = 1.0
            slots[size] = scale
            slots[size + 1 :] = self.first * scale
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

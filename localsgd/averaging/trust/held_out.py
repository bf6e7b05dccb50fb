"""How a group of ranks evaluates candidate models on the judge's held-out batch
(`localsgd.averaging.trust.trusted_round`): the anchor, each contribution applied to it, the
aggregate, the aggregate without each contribution.

Every rank must hold every candidate's per-sample losses, the same bits on every rank, so the
verdicts agree. Three ways to get them, the cheapest the group allows (`HeldOutLosses.of`):

- **by samples** (`Judge.batch` given, `Judge.split_evaluation`): the batch is cut into `size`
  contiguous parts and rank k evaluates every candidate on part k only; one all-gather of the
  per-sample losses (float64) gives every rank the whole batch of every candidate. A rank runs
  `candidates / size` batches' worth of forward passes: at 4 workers a round's anchor, 4
  contributions and aggregate cost each rank 1.5 batches instead of 3;
- **by candidate** (no `batch`): candidate j is evaluated whole by rank j % size, the results
  all-gathered; a lone candidate, and the anchor, are evaluated by every rank (no collective);
- **locally** (one rank, `split_evaluation=False`, or a group whose members do not each run a
  share of the work: torchft's replica groups): every rank evaluates every candidate.

A sample's loss is computed the same way on whichever rank evaluates it, but a batch cut into
parts need not give the bits of the whole batch (a matrix product may sum in another order for
another number of rows): the verdicts are the same on every rank either way, and the same as
the whole batch's unless a score sits on a threshold to the last bit.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.trust.judge import Judge, per_sample

Change = list[torch.Tensor] | None  # one tensor per flat buffer; None: the anchor itself


class HeldOutLosses:
    """The held-out losses of candidate models (see the module doc). `sign`: a candidate is
    the anchor plus `sign * change`. `mirror`: sharded parameters' `FlatBuffers`, shown to the
    model before each evaluation (its forward is then a collective of the replica, whose ranks
    share a place in `comm`, so they evaluate the same part)."""

    def __init__(self, judge: Judge, sign: int, mirror: FlatBuffers | None):
        self.judge = judge
        self.sign = sign
        self.mirror = mirror
        self.length = 0  # the batch's length, from the last whole-batch evaluation

    def of(
        self,
        flats: list[torch.Tensor],
        anchors: list[torch.Tensor],
        changes: list[Change],
        round_: int,
        comm: Communicator,
    ) -> list[torch.Tensor]:
        """Each candidate's per-sample losses on round `round_`'s batch, on every rank. `flats`
        are left holding the last candidate evaluated."""
        size = comm.size
        if size == 1 or not self.judge.split_evaluation or not comm.splits_work:
            return [self.loss_of(flats, anchors, change, round_) for change in changes]
        if self.judge.batch:
            return self._by_samples(flats, anchors, changes, round_, comm)
        return self._by_candidate(flats, anchors, changes, round_, comm)

    def loss_of(self, flats, anchors, change: Change, round_: int, samples=None) -> torch.Tensor:
        """The losses of the model moved from the anchor by `change`, on the batch's `samples`
        (a slice; None: all of it)."""
        for i, (flat, anchor) in enumerate(zip(flats, anchors, strict=True)):
            flat.copy_(anchor)
            if change is not None:
                flat.add_(change[i], alpha=self.sign)
        if self.mirror is not None:  # the model computes with its own (sharded) tensors
            self.mirror.show()
        if samples is None:
            losses = per_sample(self.judge.loss_at(round_))
            self.length = losses.numel()
            return losses
        losses = per_sample(self.judge.loss_at(round_, samples))
        if losses.numel() != samples.stop - samples.start:
            raise ValueError(
                f"loss_at(round, slice({samples.start}, {samples.stop})) returned "
                f"{losses.numel()} losses: with Judge.batch = {self.judge.batch} it must "
                "evaluate exactly that part of the round's batch"
            )
        return losses

    def _by_samples(self, flats, anchors, changes, round_, comm) -> list[torch.Tensor]:
        size, batch = comm.size, self.judge.batch
        bounds = [batch * k // size for k in range(size + 1)]
        width = -(-batch // size)
        part = slice(bounds[comm.rank], bounds[comm.rank + 1])
        mine = torch.zeros(len(changes), width, dtype=torch.float64)
        for i, change in enumerate(changes):
            mine[i, : part.stop - part.start] = self.loss_of(flats, anchors, change, round_, part)
        everyone = self._gather(mine, flats, comm).view(size, len(changes), width)
        return [
            torch.cat([everyone[k, i, : bounds[k + 1] - bounds[k]] for k in range(size)])
            for i in range(len(changes))
        ]

    def _by_candidate(self, flats, anchors, changes, round_, comm) -> list[torch.Tensor]:
        size = comm.size
        local = {i for i, change in enumerate(changes) if change is None}
        if len(changes) - len(local) <= 1:  # one model: nothing to share out
            return [self.loss_of(flats, anchors, change, round_) for change in changes]
        out: list[torch.Tensor | None] = [None] * len(changes)
        for i in local:  # first: they give the batch's length
            out[i] = self.loss_of(flats, anchors, None, round_)
        shared = [i for i in range(len(changes)) if i not in local]
        if not self.length:  # no whole-batch evaluation yet on this rank
            self.length = self.loss_of(flats, anchors, None, round_).numel()
        slots = -(-len(shared) // size)
        mine = torch.zeros(slots, self.length, dtype=torch.float64)
        for slot, i in enumerate(shared[comm.rank :: size]):
            mine[slot] = self.loss_of(flats, anchors, changes[i], round_)
        everyone = self._gather(mine, flats, comm).view(size, slots, -1)
        for j, i in enumerate(shared):
            out[i] = everyone[j % size, j // size]
        return out

    @staticmethod
    def _gather(mine: torch.Tensor, flats, comm: Communicator) -> torch.Tensor:
        """Every rank's `mine` (all the same shape), in rank order, on the CPU; the float64
        all-gather is counted in `comm_bytes`."""
        device = flats[0].device
        everyone = torch.empty(comm.size * mine.numel(), dtype=torch.float64, device=device)
        comm.all_gather_(everyone, mine.view(-1).to(device))
        return everyone.cpu()

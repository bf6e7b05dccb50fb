"""The judge's two checks of a contribution against the round's aggregate
(`localsgd.averaging.trust.trusted_round`): the aggregate with it against the aggregate without
it, on the round's held-out batch. A score says what a contribution does applied alone; these
ask what it does to the round, where the two disagree:

- **spoilers**: a contribution that helps alone can still drag the aggregate backwards (a
  flipped sign that happens to lower the loss alone). Looked for where the aggregate of what
  passed gains less than `score_fraction` of what the median contribution gains alone;
- **spared**: a contribution can raise the loss alone and still be a good part of the
  aggregate. Under plain local SGD at a high learning rate each worker's local model
  overshoots in its own direction, and their mean gains far more than any of them alone. On
  issue 47's 64-step MNIST-1D job (4 workers, `sync.score=true`, `data.val_fraction=0`, no
  attacker), at rounds 5, 6 and 7 honest worker 0 scored -0.130, -0.077 and -0.328 alone,
  3.2, 3.1 and 4.8 standard errors worse than the median contribution (which scored 0.009,
  -0.022 and 0.020): judged bad 3 rounds running and excluded at round 7. The scores' spread
  there is the local models' own (0.18 to 0.46 between the best and the worst worker), which
  the paired test over the batch takes for evidence. Yet the mean of the three others gained
  0.134, 0.044 and 0.122, and putting worker 0 back into it changed that by -0.025, +0.005 and
  -0.029 (2.2, -0.6 and 2.0 standard errors). So where the aggregate of the contributions not
  judged bad alone gains more than 1 / `score_fraction` times what the median contribution
  gains alone, a contribution judged bad alone is kept unless adding it to that aggregate
  makes it worse by more than `score_z` standard errors. It costs one forward pass per
  contribution judged bad alone, in such rounds only (the aggregate without them is
  evaluated anyway, for the spoilers).

Under a per-coordinate rule (the median, the trimmed mean) the aggregate held against is the
mean (`TrustedRound.held_against`): those rules hide one outlier whether it is in or out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.trust.held_out import HeldOutLosses
from localsgd.averaging.trust.judge import Judge, worse

Combine = Callable[[list[torch.Tensor], list[int]], list[torch.Tensor] | None]


class LeaveOneOut:
    """The two checks of one round (see the module doc): `before`, the anchor's per-sample
    losses; `combine(rows, subset)`: the aggregate of a subset of the gathered `rows` (places
    in the gather), each evaluated once on the round's batch by `held_out`."""

    def __init__(
        self,
        judge: Judge,
        held_out: HeldOutLosses,
        combine: Combine,
        flats: list[torch.Tensor],
        anchors: list[torch.Tensor],
        rows: list[torch.Tensor],
        before: torch.Tensor,
        round_: int,
        comm: Communicator,
    ):
        self.judge = judge
        self.held_out = held_out
        self.combine = combine
        self.flats, self.anchors, self.rows = flats, anchors, rows
        self.before = before
        self.round = round_
        self.comm = comm
        self.evaluated: dict[tuple[int, ...], torch.Tensor] = {}

    def losses(self, subsets: list[list[int]]) -> list[torch.Tensor]:
        """The per-sample losses of the aggregate of each subset (evaluated together, each
        subset once a round)."""
        keys = [tuple(subset) for subset in subsets]
        new = list(dict.fromkeys(k for k in keys if k not in self.evaluated))
        if new:
            changes = [self.combine(self.rows, list(k)) for k in new]
            got = self.held_out.of(self.flats, self.anchors, changes, self.round, self.comm)
            self.evaluated.update(zip(new, got, strict=True))
        return [self.evaluated[k] for k in keys]

    def gain(self, losses: torch.Tensor) -> float:
        return float((self.before - losses).mean())

    def spared(self, alone: list[int], suspects: list[int], middle: float) -> list[int]:
        """The `suspects` (judged bad alone) that the aggregate of `alone` (those that were not)
        does not hold against: only in a round where that aggregate gains more than
        1 / `score_fraction` times the median contribution's gain alone, each suspect whose
        addition to it does not make it worse by more than `score_z` standard errors of the
        paired differences."""
        judge = self.judge
        if not suspects or not alone:
            return []
        (without,) = self.losses([alone])
        gain = self.gain(without)
        if not (gain > 0 and middle < judge.score_fraction * gain):
            return []
        evaluated = self.losses([sorted([*alone, rank]) for rank in suspects])
        return [
            rank
            for rank, together in zip(suspects, evaluated, strict=True)
            if not worse(together, without, judge.score_z)
        ]

    def spoilers(self, keep: list[int], middle: float) -> list[int]:
        """The contributions of `keep` that spoil the aggregate, looked for only in a round whose
        aggregate gains less than `score_fraction` of what the median contribution gains on its
        own (or raises the loss, when the median does not help). It spoils the aggregate when
        leaving it out gains something, and putting it back loses at least `score_fraction` of
        that gain, by more than `score_z` standard errors of the paired differences (without
        this, the LM's flipped sign under the median stayed in for 5 rounds)."""
        judge = self.judge
        if len(keep) < 2:
            return []
        (together,) = self.losses([keep])
        if self.gain(together) >= judge.score_fraction * max(middle, 0.0):
            return []
        rests = [[r for r in keep if r != rank] for rank in keep]
        harmful = []
        for rank, without in zip(keep, self.losses(rests), strict=True):
            gain = self.gain(without)
            harm = float((together - without).mean())
            if (
                gain > 0
                and harm >= judge.score_fraction * gain
                and worse(together, without, judge.score_z)
            ):
                harmful.append(rank)
        return harmful

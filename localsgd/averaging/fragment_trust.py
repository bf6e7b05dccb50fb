"""Robust aggregates and scoring over Streaming DiLoCo's fragments (`sync.aggregate` with
`sync.fragments > 1`; docs/reliability.md, "Workers you cannot trust").

`TrustedFragments` is `Fragments` (`localsgd.averaging.fragments`) whose blocking round runs a
`trust.TrustedRound` instead of the all-reduced mean. At fragment p's sync (its own step, τ = 0):

1. each rank's pseudo-gradient of fragment p, `anchor - local` over the fragment's pieces, is
   gathered from every rank in rank order (`robust.GatheredContributions`, one per fragment:
   through the fragment's low-bit wire when `comm_dtype` sets one, with its error-feedback
   residuals);
2. the rows holding NaN or Inf are dropped (an event names the rank and the round), then, with
   a `Judge`, the rest are scored and bad ones dropped, then combined by the `Aggregate` rule;
3. the result is the fragment's pseudo-gradient: its outer SGD steps the fragment's anchor, and
   the fragment's local values become the anchor (α = 0, DiLoCo's replacement), as in the
   all-reduced round (`Fragments.blocking`).

Every rank holds the same gathered bytes and runs the same operations, so every rank reaches
the same bits; with the `mean` rule the result is the gathered mean summed in rank order, not
the all-reduce's bits (the all-reduced mean is `Fragments` itself, untouched).

**One verdict state for all fragments.** The fragments' rounds are the rounds of one
`TrustedRound`: round r is the r-th fragment sync, whichever fragment it is. Its bad-round
streaks and exclusions are per worker, so a worker excluded by one fragment's rounds is excluded
from every fragment's: an attacker is one worker, not one fragment, and it sends every fragment
from the same model. A streak therefore runs across fragments (`exclude_after` bad fragment
rounds running), so an attacker judged bad at every sync is excluded within `exclude_after`
fragment syncs, a fraction `exclude_after / P` of one period. Probation
(`Judge.probation_rounds`) counts each fragment's first rounds: a worker's first
`probation_rounds` x P fragment rounds. Its first round of each fragment is its first change
of that part of the model, so a worker whose contributions of every fragment turn bad once it
has sent each one (a replay of its first rounds, say) is still a newcomer there.

**Scoring** (`Judge`). A fragment's candidate change is evaluated on the whole model, so the
model evaluated must be the same on every rank: during the round every other fragment is set
to its anchor (Streaming DiLoCo with an outer step keeps each anchor identical on every rank;
`StreamingAverager.global_state`), fragment p to its anchor plus the candidate (the judge's
`loss_at` reads the model through the flat buffers the parameters are views of), and after the
round the other fragments' local values are put back exactly (copied from a stash, one model of
memory, kept only with a judge). Tensors outside the flat buffers (integer buffers) stay local:
they must not change the evaluated loss (BatchNorm's step counter does not, in eval mode).

Only the blocking, anchored schedule is built (`refusal` says why each other one is not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.compress import CommFormat
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.fragments import Fragments, Tensors
from localsgd.averaging.robust import Aggregate, GatheredContributions
from localsgd.averaging.trust import Judge, TrustedRound


def refusal(
    outer: bool, delay: int, merge_alpha: float, eager: bool, progress: bool, levels: bool,
    host: bool,
) -> str | None:
    """Why a robust aggregate over fragments cannot hold with these streaming settings, or
    None (the averager's arguments; the config checks say the same in `SyncPlan.trust_refusal`)."""
    for hit, why in (
        (not outer, "outer=False: plain streaming sends the values themselves, not "
         "pseudo-gradients from an anchor every rank holds"),
        (delay > 0, "delay_steps > 0: a delayed fragment is merged steps after it was sent, "
         "while its verdicts would need the gathered rows at once (not built)"),
        (eager, "eager: each worker steps its own anchor with its own fresh pseudo-gradient "
         "before any aggregate exists"),
        (merge_alpha > 0 or progress, "merge_alpha > 0 or merge_rule='progress': the merge "
         "keeps part of each worker's own values, so a poisoned replica is never replaced"),
        (levels, "inner_levels: each level would judge its own group"),
        (host, "outer_state='cpu': the contributions are judged on the device"),
    ):
        if hit:
            return f"a robust aggregate over fragments does not compose with {why}"
    return None


class TrustedFragments(Fragments):
    """`Fragments` whose blocking round is a `TrustedRound` over fragment p's pseudo-gradients
    (see the module doc). `step_of()`: the averager's step, named in the events."""

    def __init__(
        self,
        flat: FlatBuffers,
        ids: list[int],
        is_param: list[bool],
        outer: dict,
        size: int,
        comm_dtype: CommFormat,
        error_feedback: bool,
        feedback_decay: float,
        aggregate: Aggregate,
        judge: Judge | None,
        step_of: Callable[[], int],
    ):
        super().__init__(flat, ids, is_param, outer, False, size, comm_dtype, error_feedback,
                         feedback_decay=feedback_decay)
        self.step_of = step_of
        decay = feedback_decay
        # sharded parameters (mirror mode): verdicts reduced across the shard group, and the
        # model the judge evaluates written into the shards (`TrustedRound`)
        if judge is not None:  # probation counts each fragment's first rounds (module doc)
            judge = replace(judge, probation_rounds=judge.probation_rounds * len(self.sent))
        self.trust = TrustedRound(
            self.sent[0], size, self.low[0], aggregate, judge, -1, decay, mirror=flat
        )
        self.gathered = [self.trust.contributions] + [
            GatheredContributions(pieces, size, low, decay)
            for pieces, low in zip(self.sent[1:], self.low[1:], strict=True)
        ]
        # the other fragments' local values while a judge evaluates fragment p on the anchors
        self.stash = [b.detach().clone() for b in flat.buffers] if judge is not None else []

    def blocking(
        self,
        p: int,
        buffers: Tensors,
        comm: Communicator,
        alpha: float,
        plain: bool,
        scale: float | None = None,
    ):
        if alpha:  # refused when the averager is built (`refusal`)
            raise ValueError("a robust aggregate over fragments needs merge_alpha=0")
        if scale is not None:  # `StreamingAverager._weigh` refuses weighted robust rounds
            raise ValueError("a robust aggregate over fragments combines contributions unweighted")
        regions = self.regions[p]
        # the pseudo-gradient in place in the model's own region, as OuterStep computes it, so
        # the judge moves the model by writing there
        pieces = [buffers[g][s:e] for g, s, _, e in regions]
        anchors = [self.anchors[g][s:e] for g, s, _, e in regions]
        for piece, anchor in zip(pieces, anchors, strict=True):
            torch.sub(anchor, piece, out=piece)
        others = self._others(p, buffers)
        try:
            self.trust.run_(
                pieces, anchors, comm, self.residuals[p], self.step_of(), self.gathered[p]
            )
        finally:  # the other fragments' local values, exactly as they were
            for g, s, e in others:
                buffers[g][s:e].copy_(self.stash[g][s:e])
        for sent, piece in zip(self.sent[p], pieces, strict=True):
            sent.copy_(piece)
        self._outer(p, self.sent[p], plain)
        self._merge(p, buffers, 0.0)

    def _others(self, p: int, buffers: Tensors) -> list[tuple[int, int, int]]:
        """With a judge: every other fragment's region stashed and set to its anchor, so the
        model the judge evaluates is the same on every rank; the regions, to restore."""
        if not self.stash:
            return []
        out = []
        for q, regions in enumerate(self.regions):
            if q == p:
                continue
            for g, s, _, e in regions:
                self.stash[g][s:e].copy_(buffers[g][s:e])
                buffers[g][s:e].copy_(self.anchors[g][s:e])
                out.append((g, s, e))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "trust": self.trust.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.trust.load_state_dict(state.get("trust", {}))

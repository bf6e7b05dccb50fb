"""`Rounds`: the stages of a sync round assembled for every part of the flat buffers.

    contribution -> wire -> transport -> combine -> outer step -> merge
    (values,        (fp32,  (blocking,   (mean,      (none,        (replace,
     change,         16-bit, launched)    gathered:   anchor+change, mix alpha,
     pseudo-         low-bit,              clip,      outer SGD)     progress)
     gradient)       top-k;                trimmed,
                     error                 median,
                     feedback)             sign,
                                           scored)

A round of part p runs the stages in order, **blocking** within one step, or **launched** at one
step (contribution, wire, transport started) and **finished** at a later one (combine, outer
step, merge), or **eager** (Kale et al. 2025: this worker's fresh pseudo-gradient stepped at once
with the others' of the round before; `eager_round`). An averager (`localsgd.averaging.averager`)
says *when* a round runs, at which level and on which part; the stages never branch on it. A
blocking round that replaces the values runs in place in the flat buffers (no copy): the model
is its own work buffer. Guarding against NaN/Inf contributions is part of every transport
(`localsgd.averaging.finite`, in band for the mean; the gathered rows are checked one by one).
"""

from __future__ import annotations

from itertools import chain

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers, Relayout
from localsgd.averaging.rounds.combine import Gathered, Mean
from localsgd.averaging.rounds.contribution import Contribution
from localsgd.averaging.rounds.merge import merge_
from localsgd.averaging.rounds.outer import Anchors, OuterSGD
from localsgd.averaging.rounds.part import Part, Tensors, new_like, views
from localsgd.averaging.rounds.wire import Wire
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.averaging.wire.compress import CommFormat


class Rounds:
    """Every part's round (see the module doc). `parts`: the whole model (`part.whole`) or the
    fragments; `contribution`: values | change | pseudo_gradient (the latter takes `outer`, the
    outer SGD's lr, momentum, nesterov and warmup_rounds); `fmt`, `error_feedback` and
    `feedback_decay`: the wire; `aggregate`/`judge`: a gathered combine (None: the mean);
    `alpha`, `progress`: the merge; `launched`: some rounds are launched (each part then keeps a
    work buffer and, for `progress`, its values at the launch); `eager`: eager rounds;
    `levels`: anchor sets for hierarchical change contributions; `anchored`: keep anchors for
    `values` too (a normalized weighted round scales about them); `host`: the anchors and outer
    state in host memory; `size`: the workers of the widest level; `mirror`: sharded parameters'
    buffers (a judge shows the model the candidates through them)."""

    def __init__(
        self,
        flat: FlatBuffers,
        parts: list[Part],
        *,
        size: int,
        contribution: str = "values",
        fmt: CommFormat = torch.float32,
        error_feedback: bool = False,
        feedback_decay: float = 1.0,
        aggregate: Aggregate | None = None,
        judge: Judge | None = None,
        outer: dict | None = None,
        host: bool = False,
        alpha: float = 0.0,
        progress: bool = False,
        launched: bool = False,
        eager: bool = False,
        levels: int = 1,
        anchored: bool = False,
        bucket_bytes: int | None = None,
    ):
        if (contribution == "pseudo_gradient") != (outer is not None):
            raise ValueError("an outer step (outer=...) needs pseudo-gradient contributions")
        buffers = flat.buffers
        self.parts = parts
        self.kind = contribution
        self.alpha, self.progress, self.eager = float(alpha), progress, eager
        self.delays = launched
        self.anchors = (
            Anchors(buffers, levels, host) if contribution != "values" or anchored else None
        )
        self.anchored = self.anchors is not None
        self.host = host and self.anchored
        self.outer = OuterSGD(parts, self.anchors, outer, self.host) if outer is not None else None
        self.contribution = Contribution(contribution, self.anchors, self.host)
        # a blocking round that replaces the values runs in place; launched, eager and mixed
        # rounds work in a copy of each part (what goes on the wire, then the mean received)
        self.in_place = not (launched or eager or self.alpha)
        self.sent = [new_like(buffers, part) for part in parts] if not self.in_place else []
        shapes = self.sent or [views(buffers, part) for part in parts]
        self.wires = [Wire(s, fmt, error_feedback, feedback_decay, bucket_bytes) for s in shapes]
        self.combine: Mean | Gathered = (
            Gathered(shapes, size, self.wires, aggregate, judge, self.contribution.sign, flat)
            if aggregate is not None
            else Mean()
        )
        count = len(parts)
        self.origins = [new_like(buffers, part) for part in parts] if progress else []
        self.flight: list = [None] * count
        self.holding = [False] * count  # a launched mean not yet consumed
        self.pending_step = [-1] * count  # the step it was launched after
        self.pending_plain = [False] * count
        if eager:  # received D, own previous d, scratch (`eager_round`)
            self.received = [new_like(buffers, part) for part in parts]
            self.own = [new_like(buffers, part) for part in parts]
            self.scratch = [new_like(buffers, part) for part in parts]
            for t in chain.from_iterable(self.own):
                t.zero_()
            # the M each own d was launched to (the live workers of that round, under torchft):
            # it is what removes this worker's share from the mean received for it
            self.own_size = [size] * count
            self.own_share: list[float | None] = [None] * count  # a weighted round's share
        # a judge evaluates the whole model: the other parts are shown at their anchors (the
        # same on every rank) and this worker's own values put back after
        judged = isinstance(self.combine, Gathered) and self.combine.judges
        self.stash = (
            [b.detach().clone() for b in buffers]
            if judged and (count > 1 or not self.in_place)
            else []
        )

    # --- what the averager reads -------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """A launched round is in flight (or restored) and not yet finished."""
        return self.delays and any(self.holding)

    @property
    def gathered(self) -> bool:
        return isinstance(self.combine, Gathered)

    @property
    def trust(self):
        """The verdict state of gathered rounds (`TrustedRound`), or None."""
        return self.combine.trust if self.gathered else None

    @property
    def residuals(self) -> list:
        """Every part's error-feedback residuals (None where nothing is rounded)."""
        return [w.residuals for w in self.wires]

    def received_in(self, p: int) -> Tensors:
        """What every rank received in part p's launched round (waited for): the mean, or the
        gathered contributions a robust rule combines at the finish."""
        if self.gathered:
            return list(self.combine.gathered_by_part[p].rows)
        return list(self.sent[p])

    @property
    def averages(self) -> Tensors:
        """What every rank received from the last launched round of a single part."""
        return self.sent[0]

    # --- the stages, one round ----------------------------------------------------------------

    def _globals(self, p: int, mean: Tensors, level: int, plain: bool) -> Tensors:
        """The outer stage: part p's new global values from its combined contribution."""
        part = self.parts[p]
        if self.outer is not None:
            return self.outer.step_(p, part, mean, plain)
        if self.kind == "change":
            for (g, s, _, e), m in zip(part, mean, strict=True):
                m.add_(self.anchors.at(level)[g][s:e])
        if self.anchors is not None:
            self.anchors.settle_(part, level, mean)
        return mean

    def offer(
        self, p: int, buffers: Tensors, out: Tensors, level: int = 0, scale: float | None = None
    ) -> None:
        """Part p's contribution from `buffers` into `out` (the contribution stage alone)."""
        staging = self.outer.staging[p] if self.outer is not None and self.host else None
        self.contribution.offer_(self.parts[p], buffers, out, level, scale, staging)

    def _anchor_views(self, p: int, level: int = 0) -> Tensors | None:
        return views(self.anchors.at(level), self.parts[p]) if self.anchors is not None else None

    def blocking(
        self,
        p: int,
        buffers: Tensors,
        comm: Communicator,
        level: int = 0,
        step: int = 0,
        plain: bool = False,
        scale: float | None = None,
        alpha: float | None = None,
    ) -> None:
        """Part p's round at `level` (its communicator `comm`), blocking. `plain`: the part's
        first round after a warmup (an outer step takes it plainly); `scale`: a normalized
        weighted round's factor of this worker's contribution; `alpha`: the merge's, for this
        round (None: the rounds')."""
        part, wire = self.parts[p], self.wires[p]
        work = views(buffers, part) if self.in_place else self.sent[p]
        self.offer(p, buffers, work, level, scale)
        if self.gathered:
            shown = self._show_anchors(p, buffers)
            try:
                self.combine.blocking(
                    p, work, comm, wire, anchors=self._anchor_views(p, level), step=step
                )
            finally:
                self._put_back(shown, buffers)
        else:
            self.combine.blocking(p, work, comm, wire)
        if self.eager:  # what every rank received, for common_tensors
            for r, d in zip(self.received[p], work, strict=True):
                r.copy_(d)
        glob = self._globals(p, work, level, plain)
        merge_(views(buffers, part), glob, self.alpha if alpha is None else alpha)

    def launch(
        self,
        p: int,
        buffers: Tensors,
        comm: Communicator,
        step: int,
        plain: bool = False,
        scale: float | None = None,
    ) -> None:
        """Part p's round, launched after step `step` (finished by `finish`)."""
        self.offer(p, buffers, self.sent[p], 0, scale)
        if self.progress:
            for o, here in zip(self.origins[p], views(buffers, self.parts[p]), strict=True):
                o.copy_(here)
        self.flight[p] = self.combine.launch(p, self.sent[p], comm, self.wires[p])
        self.holding[p], self.pending_step[p], self.pending_plain[p] = True, step, plain

    def finish(
        self, p: int, buffers: Tensors, comm: Communicator | None = None, step: int = 0
    ) -> None:
        """Part p's launched round: wait for it, combine (a gathered one's judge evaluates the
        candidates on the model, whose values are put back after), step and merge."""
        self.wait(p)
        if self.gathered:
            shown = self._show_anchors(p, buffers, everything=True)
            try:
                self.combine.finish(
                    p, self.sent[p], comm, self._anchor_views(p), step,
                    model=views(buffers, self.parts[p]) if shown else None,
                )  # fmt: skip
            finally:
                self._put_back(shown, buffers)
        glob = self._globals(p, self.sent[p], 0, self.pending_plain[p])
        origins = self.origins[p] if self.progress else None
        merge_(views(buffers, self.parts[p]), glob, self.alpha, origins)
        self.holding[p] = False

    def eager_round(
        self, p: int, buffers: Tensors, comm: Communicator, step: int, scale: float | None = None
    ) -> bool:
        """Part p's eager round (Kale et al. 2025): this worker m's fresh pseudo-gradient
        `d_t = anchor_m - local` goes out, the mean `D_{t-1}` launched at the round before (zeros
        at the first) comes in, and the outer step takes `d_t/M + D_{t-1} - d_{t-1}/M` at once:
        its own fresh contribution plus the others' one round late. Anchors and outer states
        are then per worker; `D_{t-1}` is the same on every rank. In a weighted round (the
        communicator's shares set) 1/M is this worker's share of each round, and `scale` (a
        normalized round's factor) multiplies its fresh contribution. Returns whether a mean
        was received."""
        self.wait(p)
        got = self.holding[p]
        if got:
            self.received[p], self.sent[p] = self.sent[p], self.received[p]
        else:
            for r, o in zip(self.received[p], self.own[p], strict=True):
                r.zero_()
                o.zero_()
        fresh, own = self.scratch[p], self.own[p]
        self.offer(p, buffers, fresh, 0, scale)
        for wire, f in zip(self.sent[p], fresh, strict=True):
            wire.copy_(f)
        # M now, read from the communicator: under torchft the live workers of this round; a
        # weighted round's share instead of 1/M (negated: it is what removes d_prev's part)
        size, prev_size = comm.size, self.own_size[p]
        share, prev_share = comm.share, self.own_share[p]
        self.flight[p] = self.wires[p].launch_mean(self.sent[p], comm)
        self.holding[p], self.pending_step[p] = True, step
        for o, r, f in zip(own, self.received[p], fresh, strict=True):
            if prev_share is None:
                o.div_(-prev_size)
            else:
                o.mul_(-prev_share)
            o.add_(r).add_(f, alpha=1 / size if share is None else share)  # D - d_prev/M' + d/M
        self.own_size[p], self.own_share[p] = size, share
        glob = self.outer.step_(p, self.parts[p], own, plain=False)
        self.own[p], self.scratch[p] = fresh, own  # the fresh d is the next round's d_prev
        merge_(views(buffers, self.parts[p]), glob, self.alpha)  # host: `own` holds the anchor
        return got

    def drop(self, p: int) -> None:
        """Forget part p's eager rounds (after a blocking average)."""
        self.wait(p)
        self.holding[p] = False

    def wait(self, p: int) -> None:
        if self.flight[p] is not None:
            self.flight[p].wait()
            self.flight[p] = None

    def wait_all(self) -> None:
        for p in range(len(self.parts)):
            self.wait(p)

    def _show_anchors(self, p: int, buffers: Tensors, everything: bool = False) -> list:
        """With a judge: the regions of the buffers a candidate's evaluation must not see as
        this worker's own (the other parts; `everything`: part p's too) stashed and set to
        their anchors; returns them, to put back. Nothing without a stash (one part in place:
        the candidates are written over the contribution, which was gathered already)."""
        if not self.stash:
            return []
        shown = []
        for q, part in enumerate(self.parts):
            if q == p and not everything:
                continue
            for g, s, _, e in part:
                self.stash[g][s:e].copy_(buffers[g][s:e])
                buffers[g][s:e].copy_(self.anchors.first[g][s:e])
                shown.append((g, s, e))
        return shown

    def _put_back(self, shown: list, buffers: Tensors) -> None:
        for g, s, e in shown:
            buffers[g][s:e].copy_(self.stash[g][s:e])

    def held_tensors(self) -> dict[str, list]:
        """The tensors the rounds hold between steps, by what they are: `anchors`,
        `outer_momentum`, `residuals`, `staging` (host, `sync.outer_state=cpu`) and `other`
        (work copies, launched values, eager rounds' buffers, a judge's stash, the wire's
        low-precision copies)."""
        momentum = [
            t
            for opt in (self.outer.optimizers if self.outer is not None else [])
            if opt is not None
            for state in opt.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        ]
        other = [*chain.from_iterable(self.sent), *chain.from_iterable(self.origins), *self.stash]
        if self.eager:
            for ts in (self.received, self.own, self.scratch):
                other += chain.from_iterable(ts)
        other += [w for wire in self.wires for w in wire.low if isinstance(w, torch.Tensor)]
        return {
            "anchors": [] if self.anchors is None else list(chain.from_iterable(self.anchors.sets)),
            "outer_momentum": momentum,
            "residuals": [r for w in self.wires for r in w.residuals if r is not None],
            "staging": [] if self.outer is None else list(chain.from_iterable(self.outer.staging)),
            "other": other,
        }

    # --- state -----------------------------------------------------------------------------------

    def reset(self, buffers: Tensors) -> None:
        """Every rank holds the same `buffers` now (after the initial broadcast)."""
        if self.anchors is not None:
            self.anchors.reset(buffers)
        for wire in self.wires:
            wire.reset()

    def relayout(self, flat: FlatBuffers, convert: Relayout) -> None:
        """The buffers were rebuilt in a new layout (a tensor changed dtype or device): only a
        whole-model round without an outer step or a robust combine follows it."""
        if self.outer is not None:
            raise ValueError(
                "a parameter changed dtype or device under an outer optimizer (DiLoCo/SlowMo): "
                "move the model (model.to(...)) before building the averager"
            )
        if self.gathered:
            raise ValueError(
                "a parameter changed dtype or device under a robust aggregate: move the model "
                "(model.to(...)) before building the averager"
            )
        if len(self.parts) != 1 or self.eager:
            raise ValueError(
                "a parameter changed dtype or device under streaming averaging: move the model "
                "(model.to(...)) before building the averager"
            )
        from localsgd.averaging.rounds.part import whole

        self.wait_all()
        self.parts = [whole(flat)]
        if self.anchors is not None:
            self.anchors.relayout(convert)
        if self.sent:
            self.sent = [convert(self.sent[0])]
        if self.origins:
            self.origins = [convert(self.origins[0])]
        shapes = self.sent or [views(flat.buffers, self.parts[0])]
        self.wires[0].relayout(shapes[0], convert)

    def state_dict(self) -> dict:
        self.wait_all()
        state: dict = {}
        if self.anchors is not None:
            state.update(self.anchors.state_dict())
        if self.outer is not None:
            state["optimizers"] = self.outer.state_dict()
        if self.wires[0].error_feedback:
            state["residuals"] = [w.state_dict() for w in self.wires]
        if self.delays or self.eager:
            state["holding"] = list(self.holding)
            state["pending_step"] = list(self.pending_step)
            state["pending_plain"] = list(self.pending_plain)
            state["sent"] = [
                [t.clone() for t in ts] if h else None
                for ts, h in zip(self.sent, self.holding, strict=True)
            ]
        if self.progress:
            state["origins"] = [
                [t.clone() for t in ts] if h else None
                for ts, h in zip(self.origins, self.holding, strict=True)
            ]
        if self.eager:
            state["own"] = [[t.clone() for t in ts] for ts in self.own]
            state["own_size"] = list(self.own_size)
            state["own_share"] = list(self.own_share)
        state.update(self.combine.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.anchors is not None and "anchors" in state:
            self.anchors.load_state_dict(state)
        if self.outer is not None and "optimizers" in state:
            self.outer.load_state_dict(state["optimizers"])
        saved = state.get("residuals") or [None] * len(self.wires)
        for wire, residuals in zip(self.wires, saved, strict=True):
            wire.load_state_dict(residuals)
        self.flight = [None] * len(self.parts)
        if "holding" in state:
            self.holding = [bool(h) for h in state["holding"]]
            self.pending_step = [int(s) for s in state["pending_step"]]
            self.pending_plain = [bool(b) for b in state["pending_plain"]]
            for ts, values in zip(self.sent, state["sent"], strict=True):
                for mine, value in zip(ts, values or [], strict=False):
                    mine.copy_(value)
        for ts, values in zip(self.origins, state.get("origins") or [], strict=False):
            for mine, value in zip(ts, values or [], strict=False):
                mine.copy_(value)
        if self.eager:
            self.own_size = [int(m) for m in state.get("own_size", self.own_size)]
            saved = state.get("own_share") or [None] * len(self.own_size)
            self.own_share = [None if s is None else float(s) for s in saved]
            for ts, values in zip(self.own, state.get("own", []), strict=False):
                for mine, value in zip(ts, values, strict=True):
                    mine.copy_(value)
        self.combine.load_state_dict(state)

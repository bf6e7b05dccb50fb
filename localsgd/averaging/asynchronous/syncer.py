"""The syncer's state: the global model, its outer optimizer and the contributions that have
arrived but are not merged yet (`Syncer`). No communication here: `service` feeds it.

A merge combines every pending contribution, each weighed by the samples it was trained on
(`sum_i n_i g_i / sum_i n_i`, in arrival order; `normalized`: each change first scaled to the
merge's most samples, by `max_j n_j / n_i`, FedNova's normalized averaging, so that a slow
worker's short change does not shrink the merged step), or by a robust rule (`aggregate`:
clip, trimmed mean, median, sign; `localsgd.averaging.trust.robust`, unweighted: an untrusted
worker could inflate the samples it reports), and takes one outer step with the result. A
contribution holding NaN or Inf is dropped from its merge (`dropped`), as from every
synchronous round: `OuterSGD` over the global model, the same class and bits as the
synchronous rounds' outer step, with torch's SGD (the synchronous step) or `DelayedNesterov`
(the default for asynchronous rounds). A contribution trained from an older global model
(stale by `version - its base version` merges) is merged as it is, or dropped where it is more
than `max_staleness` merges old (`too_stale`: its worker takes the newest model all the same);
Delayed Nesterov is what tames it, and with `correction` (`heloco.HeLoCo`) each contribution
is first corrected, block by block (`blocks`: the parameter tensors), against the outer
momentum as it stands before the merge.

**Fragments** (Streaming DiLoCo, `parts` more than one): each contribution is one fragment's
(a meeting's: one per fragment), and each fragment is its own global model as above: its own
outer optimizer, its own version (`versions`; a contribution's staleness counts its fragment's
merges) and its own first plain merge. A merge steps every fragment that has contributions
pending, in fragment order; `version` counts every fragment's merges, and `merged_samples`
counts a fragment's samples as that share of the model (`1/P` each).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from localsgd.averaging.asynchronous.fleet_period import FleetPeriod
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.finite import all_finite
from localsgd.averaging.rounds.outer import Anchors, OuterSGD
from localsgd.averaging.rounds.part import Part, Tensors, views
from localsgd.averaging.trust.robust import Aggregate


@dataclass
class Arrival:
    """One worker's contribution (its pseudo-gradient, `anchor - local`), as it arrived."""

    worker: int
    time: float  # when it was sent: modelled seconds, or the syncer's clock
    samples: float  # what it was trained on: its weight
    version: int  # its fragment's version it was trained from
    tensors: Tensors
    fragment: int = 0
    loss: list[float] | None = None  # its worker's [mean loss, steps] since its last exchange
    # a senders' mean (top-k, `sync.topk_mean=senders`): per piece, where its message held an
    # index (None: a piece sent whole)
    sent: list[torch.Tensor | None] | None = None
    # a phase's (an adaptive period counts it towards its next decision), not a meeting's
    phase: bool = True


class Syncer:
    """The global model (`anchors.first`, laid out as the flat buffers), its outer optimizer
    (`sgd`: lr, momentum, nesterov, warmup_rounds, optimizer; one per part of `parts`: the
    whole model, or each fragment) and the pending contributions.
    `plain_first`: the first merge is a plain average (after a synchronous warmup, as the
    synchronous rounds' first). `aggregate`: a robust rule instead of the weighted mean.
    `normalized`: the weighted mean of the changes scaled to the merge's most samples."""

    def __init__(
        self,
        buffers: Tensors,
        parts: list[Part],
        sgd: dict,
        plain_first: bool = False,
        aggregate: Aggregate | None = None,
        correction: HeLoCo | None = None,
        blocks: list[tuple[int, int, int]] = (),
        normalized: bool = False,
        max_staleness: int | None = None,
        period: FleetPeriod | None = None,
    ):
        self.parts = parts
        self.period = period  # an adaptive period, decided here (`fleet_period`)
        self.max_staleness = max_staleness
        self.normalized = normalized
        self.aggregate = aggregate
        self.correction = correction
        # each part's blocks (a buffer g's slice at offset o, numel k), as (slice, start, end)
        # in that part's slices
        self.blocks = [
            [
                (i, o - s, o - s + k)
                for g, o, k in blocks
                for i, (h, s, _, e) in enumerate(part)
                if h == g and s <= o < e
            ]
            for part in parts
        ]
        self.dropped: list[tuple[int, float]] = []  # (worker, time) of each non-finite one
        # (worker, time, staleness) of each one older than max_staleness merges
        self.too_stale: list[tuple[int, float, int]] = []
        self.anchors = Anchors([b.detach().clone() for b in buffers])
        self.outer = OuterSGD(parts, self.anchors, sgd)
        self.plain_first = plain_first
        self.versions = [0] * len(parts)  # each part's merges so far: its version
        self.pending: list[Arrival] = []
        self.merged_samples = 0.0
        self.staleness: list[int] = []  # of every merged contribution, in merge order

    @property
    def values(self) -> Tensors:
        """The global model, as flat buffers."""
        return self.anchors.first

    def values_of(self, fragment: int | None) -> Tensors:
        """The global values of one part (None: the whole model), one view per slice."""
        if fragment is None:
            return list(self.values)
        return views(self.values, self.parts[fragment])

    @property
    def version(self) -> int:
        """Every part's merges: the global model's version (the one part's, unfragmented)."""
        return sum(self.versions)

    def add(self, arrival: Arrival) -> None:
        self.pending.append(arrival)

    def workers_pending(self) -> int:
        return len({a.worker for a in self.pending})

    def merge(self) -> bool:
        """Merge every pending contribution, fragment by fragment; whether one was merged."""
        pending, self.pending = self.pending, []
        self.reported([(a.worker, a.loss, int(a.phase)) for a in pending])
        merged = False
        for f in range(len(self.parts)):
            merged |= self._merge([a for a in pending if a.fragment == f and a.samples > 0], f)
        return merged

    def reported(self, reports: list[tuple[int, list[float] | None, int]]) -> None:
        """The losses of contributions merged (`FleetPeriod.merged`), where the period adapts."""
        if self.period is not None:
            self.period.merged(reports)

    def _merge(self, arrived: list[Arrival], f: int) -> bool:
        if not arrived:
            return False
        finite = [all_finite(a.tensors) for a in arrived]
        self.dropped += [
            (a.worker, a.time) for a, ok in zip(arrived, finite, strict=True) if not ok
        ]
        keep = [i for i, ok in enumerate(finite) if ok]
        staleness = [self.versions[f] - a.version for a in arrived]
        if self.max_staleness is not None:  # trained from a model too old: not merged
            self.too_stale += [
                (arrived[i].worker, arrived[i].time, staleness[i])
                for i in keep
                if staleness[i] > self.max_staleness
            ]
            keep = [i for i in keep if staleness[i] <= self.max_staleness]
        if not keep:
            return False
        if self.correction is not None:
            self._correct([arrived[i] for i in keep], f)
        pieces = range(len(self.parts[f]))
        senders = arrived[0].sent is not None  # a senders' mean: each index by who sent it
        if self.aggregate is not None:  # the rule reads the contributions as rows
            rows = [torch.stack([a.tensors[i] for a in arrived]) for i in pieces]
            sent = None
            if senders:
                sent = [
                    None if arrived[0].sent[i] is None
                    else torch.stack([a.sent[i] for a in arrived])
                    for i in pieces
                ]  # fmt: skip
            mean = self.aggregate.combine(rows, keep, sent)
        else:
            mean = self._weighted_mean([arrived[i] for i in keep], senders)
        self.staleness += [staleness[i] for i in keep]
        self.step_(mean, sum(arrived[i].samples for i in keep), len(keep), f)
        return True

    def _weighted_mean(self, kept: list[Arrival], senders: bool) -> list[torch.Tensor]:
        """The contributions' mean weighed by their samples, summed in arrival order (no stacked
        copy). `normalized`: each change scaled to the merge's most samples first (n_i x most /
        n_i = most). `senders`: each index of a top-k piece divided by the samples of the
        contributions that sent it, as a synchronous round's senders' mean does (an index one
        worker sent moves by its whole value), where the others divide by the merge's samples."""
        total = sum(a.samples for a in kept)
        most = max(a.samples for a in kept)
        mean = [torch.zeros_like(t) for t in kept[0].tensors]
        by_senders = [None] * len(mean)
        if senders:
            by_senders = [None if s is None else torch.zeros_like(m)
                          for s, m in zip(kept[0].sent, mean, strict=True)]  # fmt: skip
        for a in kept:
            weight = most if self.normalized else a.samples
            for i, (m, t) in enumerate(zip(mean, a.tensors, strict=True)):
                if by_senders[i] is None:
                    m.add_(t, alpha=weight / total)
                else:
                    m.add_(t, alpha=weight)
                    by_senders[i].add_(a.sent[i].to(m.dtype), alpha=a.samples)
        for m, count in zip(mean, by_senders, strict=True):
            if count is not None:
                m.div_(count.masked_fill_(count == 0, 1.0))
        return mean

    def _load_outer(self, saved: list) -> None:
        """The outer optimizers' checkpointed state, kept at this run's N: with
        `sync.outer_delay=null` N is the number of workers, so a run resumed at another world
        size may hold torch's SGD (N = 1) where the checkpoint has Delayed Nesterov, or the
        other way round. The momentum carries over either way; a cycle in progress under the
        old N (its pending sum, whose contributions were already stepped plainly) does not."""
        for opt, state in zip(self.outer.optimizers, saved, strict=True):
            if opt is None or state is None:
                continue
            own = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            state = copy.deepcopy(state)
            if ("delay" in own[0]) != ("delay" in state["param_groups"][0]):
                state["state"] = {
                    k: {"momentum_buffer": v["momentum_buffer"]}
                    for k, v in state["state"].items()
                    if "momentum_buffer" in v
                }
                state["param_groups"] = [
                    {**mine, "params": g["params"]}
                    for mine, g in zip(own, state["param_groups"], strict=True)
                ]
            opt.load_state_dict(state)
            for group, mine in zip(opt.param_groups, own, strict=True):
                if "delay" in mine:  # this run's N, not the checkpoint's
                    group["delay"] = mine["delay"]

    def _correct(self, arrived: list[Arrival], f: int) -> None:
        """HeLoCo: each contribution against the outer momentum before this merge (None where
        the optimizer has none yet: the block is kept)."""
        opt = self.outer.optimizers[f]
        momenta: dict[int, torch.Tensor | None] = {}
        mu = 0.0
        if opt is not None:
            mu = opt.param_groups[0]["momentum"]
            holding = [i for i, (_, s, n, _) in enumerate(self.parts[f]) if n > s]
            for i, param in zip(holding, opt.param_groups[0]["params"], strict=True):
                momenta[i] = opt.state.get(param, {}).get("momentum_buffer")
        for a in arrived:
            pairs = []
            for i, lo, hi in self.blocks[f]:
                m = momenta.get(i)
                pairs.append((a.tensors[i][lo:hi], None if m is None else m[lo:hi]))
            self.correction.correct_(pairs, mu)

    def step_(self, mean: Tensors, samples: float, contributions: int, f: int = 0) -> None:
        """One outer step of part `f` by its combined pseudo-gradient `mean` of `contributions`
        workers' (a merge's, or a synchronous round's all-reduced one,
        `service.SyncerService.collective_merged`)."""
        opt = self.outer.optimizers[f]
        if opt is not None:  # Delayed Nesterov counts its cycle in it
            opt.contributions = contributions
        plain = self.plain_first and self.versions[f] == 0
        self.outer.step_(f, self.parts[f], mean, plain)
        self.versions[f] += 1
        self.merged_samples += samples / len(self.parts)

    def state_dict(self) -> dict:
        if self.pending:
            raise RuntimeError("the syncer checkpoints between meetings only")
        return {
            **self.anchors.state_dict(),
            "optimizers": self.outer.state_dict(),
            "version": self.version,
            "versions": list(self.versions),
            "merged_samples": self.merged_samples,
            "staleness": list(self.staleness),
            "dropped": [list(d) for d in self.dropped],
            "too_stale": [list(d) for d in self.too_stale],
            "corrected": dict(self.correction.counts) if self.correction is not None else {},
            "period": self.period.state_dict() if self.period is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        versions = [int(v) for v in state.get("versions", [state["version"]])]
        if len(versions) != len(self.parts):
            raise ValueError(
                f"the checkpoint's syncer has {len(versions)} fragments, this run "
                f"{len(self.parts)} (sync.fragments)"
            )
        self.anchors.load_state_dict(state)
        self._load_outer(state["optimizers"])
        self.versions = versions
        self.merged_samples = float(state["merged_samples"])
        self.staleness = [int(s) for s in state["staleness"]]
        self.dropped = [(int(w), float(t)) for w, t in state.get("dropped", [])]
        self.too_stale = [(int(w), float(t), int(s)) for w, t, s in state.get("too_stale", [])]
        if self.correction is not None:
            self.correction.counts.update(state.get("corrected", {}))
        if self.period is not None and state.get("period") is not None:
            self.period.load_state_dict(state["period"])

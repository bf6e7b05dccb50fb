"""One round over gathered contributions: drop what is not finite, score, exclude, aggregate.

`TrustedRound` is what a gathered round's combine stage (`rounds.combine.Gathered`) calls at each
sync once it holds this rank's contribution (`localsgd.averaging.trust.robust` gathers and combines
them):

1. every rank's contribution is gathered in rank order;
2. a contribution that holds NaN or Inf is dropped from the round (an event names the rank and
   the round); the round goes on with the rest;
3. with a `Judge`, each remaining contribution is scored: the loss change it causes on a small
   batch every rank draws from the round's seed (Templar's Gauntlet): `loss(anchor) -
   loss(anchor + contribution)`, positive when it helps. It is bad when it is not finite, or
   when the round's median score is positive, its own is at most `score_fraction` times that
   median (a free rider's zero change scores 0; a flipped sign scores below 0), and its
   per-sample losses are worse than the median contribution's by more than `score_z` standard
   errors (a paired test over the batch): an honest contribution that is merely unlucky on a
   small batch, late in training when every change is small, is not condemned. In a round whose
   median score is not positive (the batch cannot tell who helps), a contribution is bad only
   when it raises the loss (score < 0) and the paired test says it is worse than the median's:
   a flipped sign in the first rounds. When the round's aggregate of what passed gains less
   than `score_fraction` of the median's own gain, each contribution is also held against the
   aggregate without it (the mean, under the median or the trimmed mean, which hide one outlier
   whether it is in or out): it is bad when putting it back undoes at least `score_fraction` of
   the rest's gain (the same paired test). A flipped sign can lower the loss applied alone, on the
   LM's first rounds more than an honest change does, and still drag the mean backwards;
   only the leave-one-out test sees that. The other way round, a contribution judged bad
   alone is kept when the aggregate of those not judged bad gains more than 1 /
   `score_fraction` times the median's own gain and adding it to that aggregate does not make
   it worse by more than `score_z` standard errors: under plain local SGD at a high learning
   rate each local model overshoots alone while their mean gains, and an honest worker was
   excluded so (`leave_one_out`'s doc has the figures). A bad contribution
   is dropped from its round; `exclude_after` bad rounds running exclude the worker: its
   contributions are dropped from every later round. A worker on probation (its first
   `probation_rounds` rounds) is excluded after 2 bad rounds running: an honest worker can
   be really worse than the others for a round or two late in training, when every change is
   small, and has by then shown rounds of help; a newcomer that is bad from the start has not.
   At most `(size - 1) // 2` workers are ever excluded (one of 4): everything here assumes an
   honest majority, and a noisy score must not whittle the group down to one worker. An
   excluded worker still takes part in the collectives and receives the model; what it learns
   never reaches the aggregate (what becomes of its shard is the training loop's:
   `localsgd.loop.data_shard`). A round a contribution is not judged bad in ends its run of bad
   rounds, whatever the median: under plain local SGD each worker's change alone can raise
   the held-out loss for tens of rounds (each local model is worse than their average), and an
   honest worker's scattered bad rounds there added up to an exclusion when such rounds kept
   the streak;
4. the rest is combined by the `Aggregate` rule.

Every rank holds the same gathered bytes, evaluates the same model on the same batch and runs
the same deterministic operations, so the verdicts (and the events) are identical on every rank.
The contribution is the round's (`rounds.contribution`): the change since the last sync, held
against the anchor, for plain local SGD; the pseudo-gradient for DiLoCo/SlowMo. `Gathered` keeps
one `TrustedRound` for every part of the model (a worker is one worker whichever part it sends);
the warmup's robust gradient average (`gradients.GradientAverager`) keeps its own.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers
from localsgd.averaging.trust.held_out import HeldOutLosses
from localsgd.averaging.trust.judge import Judge, paired_z, worse
from localsgd.averaging.trust.leave_one_out import LeaveOneOut
from localsgd.averaging.trust.robust import (
    COORDINATE_RULES,
    PER_COORDINATE,
    Aggregate,
    GatheredContributions,
    finite_rows,
    median_of,
)
from localsgd.averaging.wire.sparse import SparseWire

MEAN = Aggregate("mean")


class TrustedRound:
    """The state and the steps of robust rounds over one group of `size` ranks (see the module
    doc). `sign`: a contribution is `sign * (local - anchor)` (-1: DiLoCo's pseudo-gradient).

    `mirror`: the `FlatBuffers` of sharded parameters (FSDP2's DTensors, `dist.shard_size`),
    whose buffers hold this rank's shards only. A contribution is then split across the shard
    group: whether it is finite, and its norm (`clip`), are reduced across that group (a small
    all-reduce inside the replica, like FSDP's own); a coordinate rule needs nothing more; a
    candidate the judge evaluates is written into the sharded parameters first, and the
    evaluation is FSDP's forward, a collective of the replica. Every rank of every replica
    then reaches the same verdicts."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        size: int,
        low: list,
        aggregate: Aggregate,
        judge: Judge | None = None,
        sign: int = 1,
        decay: float = 1.0,
        mirror: FlatBuffers | None = None,
        shards: dist.ProcessGroup | None = None,
    ):
        # `decay`: error feedback's beta (`compress`), for a low-precision wire's residuals;
        # `shards`: the shard group, given where the buffers are no `FlatBuffers` (gradients)
        if aggregate.rule in COORDINATE_RULES and any(isinstance(w, SparseWire) for w in low):
            raise ValueError(f"aggregate {aggregate.rule} over top-k messages: {PER_COORDINATE}")
        self.contributions = GatheredContributions(buffers, size, low, decay)
        self.current = self.contributions  # the round's, `run_`
        self.mirror = mirror if mirror is not None and mirror.mirror else None
        self.shards = shards or (self.mirror.shard_group() if self.mirror is not None else None)
        # sharded, a rule that reads norms: each row's whole norm and length, this round
        self.norms: list[float] | None = None
        self.numel: int | None = None
        self.aggregate = aggregate
        self.judge = judge
        self.held_out = HeldOutLosses(judge, sign, self.mirror) if judge is not None else None
        self.size = size
        self.rounds = 0
        self.streaks = [0] * size  # bad rounds running, per rank
        self.verdicts: list[list[int]] = [[] for _ in range(size)]  # judged rounds, 1: bad
        self.excluded: dict[int, int] = {}  # rank: the round it was excluded at
        self.events: list[dict] = []  # {"round", "step", "rank", "why"}: nonfinite | bad | excluded
        self.scores: list[float | None] = [None] * size  # the last scored round's, by worker
        self.zs: list[float | None] = [None] * size  # ... and its paired z against the median's
        self.seen = [0] * size  # the rounds each worker took part in (probation_rounds)

    def run_(
        self,
        flats: list[torch.Tensor],
        anchors: list[torch.Tensor],
        comm: Communicator,
        residuals: list[torch.Tensor | None],
        step: int,
        contributions: GatheredContributions | None = None,
    ) -> None:
        """`flats` hold this rank's contribution; they receive the aggregate (zeros when no
        contribution is left). `contributions`: where they are gathered, when the rounds take
        turns over parts of the model (Streaming DiLoCo's fragments: `rounds.combine.Gathered`
        keeps one per part); None: the buffers this round was built for."""
        workers, live = comm.members()
        self._grow(max(workers, default=-1) + 1)
        self.current = contributions or self.contributions
        rows = self.current.gather_(flats, comm, residuals, len(workers))
        self._settle(flats, anchors, comm, step, rows, workers, live)

    def settle_(
        self,
        flats: list[torch.Tensor],
        anchors: list[torch.Tensor],
        comm: Communicator,
        step: int,
        contributions: GatheredContributions,
    ) -> None:
        """`run_` for contributions whose gather was launched earlier
        (`GatheredContributions.launch_gather_`): waits for it, then judges and combines into
        `flats` (the model's values, for a judge, which evaluates candidates there)."""
        workers, live = comm.members()
        self._grow(max(workers, default=-1) + 1)
        self.current = contributions
        rows = contributions.wait()
        self._settle(flats, anchors, comm, step, rows, workers, live)

    def _settle(self, flats, anchors, comm, step, rows, workers, live) -> None:
        finite = finite_rows(rows)
        if self.shards is not None:
            finite = self._across_shards(rows, finite)
        round_ = self.rounds
        keep = []  # the rows kept, by their place in the gather
        for at, worker in enumerate(workers):
            if not live[at]:  # under torchft: healing in this round, it holds a peer's copy
                continue
            self.seen[worker] += 1
            if not finite[at]:
                self._event(round_, step, worker, "nonfinite")
                self._bad(round_, step, worker)
            elif worker not in self.excluded:
                keep.append(at)
        if self.judge is not None and keep:
            keep = self._judged(flats, anchors, rows, keep, round_, step, comm, workers)
        result = self._combine(rows, keep)
        for i, flat in enumerate(flats):
            if result is None:
                flat.zero_()
            else:
                flat.copy_(result[i])
        self.rounds += 1

    def _mean(self, rows: list[torch.Tensor], keep: list[int]) -> list[torch.Tensor] | None:
        return MEAN.combine(rows, keep, self.current.sent, None)

    def _combine(self, rows: list[torch.Tensor], keep: list[int]) -> list[torch.Tensor] | None:
        norms = None if self.norms is None else [self.norms[i] for i in keep]
        return self.aggregate.combine(rows, keep, self.current.sent, norms, self.numel)

    def _across_shards(self, rows: list[torch.Tensor], finite: list[bool]) -> list[bool]:
        """Sharded parameters: each row finite in every shard (and, for a rule that reads
        norms, each row's norm and the contribution's length over every shard), reduced across
        the shard group: the same on every rank."""
        size = len(finite)
        norms = self.aggregate.needs_norms
        # one all-reduce: the count of shards where each row is not finite, then (norms) the
        # squares of each row summed over this rank's shard, and its length
        width = 2 * size + 1 if norms else size
        out = torch.zeros(width, dtype=torch.float64, device=rows[0].device)
        out[:size] = torch.tensor([0.0 if ok else 1.0 for ok in finite], dtype=torch.float64)
        if norms:
            for r in rows:
                for i in range(size):
                    out[size + i] += r[i].double().square().sum()
            out[2 * size] = float(sum(r.shape[1] for r in rows))
        dist.all_reduce(out, group=self.shards)
        out = out.cpu()
        if norms:
            self.norms = out[size : 2 * size].sqrt().tolist()
            self.numel = int(out[2 * size])
        return (out[:size] == 0).tolist()

    def _grow(self, workers: int) -> None:
        """Room in the per-worker state for `workers` workers (under torchft the group's size
        is known only once its members gather)."""
        if workers > self.size:
            self.streaks += [0] * (workers - self.size)
            self.verdicts += [[] for _ in range(workers - self.size)]
            self.scores += [None] * (workers - self.size)
            self.zs += [None] * (workers - self.size)
            self.seen += [0] * (workers - self.size)
            self.size = workers

    def _judged(self, flats, anchors, rows, keep, round_, step, comm, workers) -> list[int]:
        """`keep` (places in the gather) less the contributions judged bad; `workers[at]`: the
        worker whose contribution is at place `at` (the scores and streaks are by worker)."""
        judge = self.judge
        changes = [[r[at] for r in rows] for at in keep]
        before, *evaluated = self.held_out.of(flats, anchors, [None, *changes], round_, comm)
        losses: dict[int, torch.Tensor] = dict(zip(keep, evaluated, strict=True))
        scores: list[float | None] = [None] * len(workers)
        for rank in keep:
            scores[rank] = float((before - losses[rank]).mean())
        self.scores = [None] * self.size  # by worker (under torchft a place is not a worker)
        for at, score in enumerate(scores):
            self.scores[workers[at]] = score
        finite = sorted((scores[r], r) for r in keep if math.isfinite(scores[r]))
        middle = median_of([s for s, _ in finite]) if finite else 0.0
        # the median contribution's per-sample losses (the two middle ones' mean, for an even
        # count): what each contribution is held against, sample by sample
        mid = [r for _, r in finite[(len(finite) - 1) // 2 : len(finite) // 2 + 1]]
        reference = torch.stack([losses[r] for r in mid]).mean(0) if mid else None
        self.zs = [None] * self.size
        for rank in keep if reference is not None else []:
            self.zs[workers[rank]] = paired_z(losses[rank], reference)
        bad = {}
        for rank in keep:
            s = scores[rank]
            if not math.isfinite(s):
                bad[rank] = True
            elif middle > 0:  # it helps less than a fraction of what the median helps
                bad[rank] = s <= judge.score_fraction * middle and worse(
                    losses[rank], reference, judge.score_z
                )
            else:  # the median does not help: only a harm the samples can see counts
                paired = losses[rank].numel() > 1
                bad[rank] = paired and s < 0 and worse(losses[rank], reference, judge.score_z)
        # judged bad alone, yet a good part of an aggregate that gains far more than they do
        # alone (each local model overshooting in its own direction: leave_one_out's doc)
        checks = LeaveOneOut(
            judge, self.held_out, self.held_against, flats, anchors, rows, before, round_, comm
        )
        alone = [rank for rank in keep if not bad[rank]]
        suspects = [rank for rank in keep if bad[rank] and math.isfinite(scores[rank])]
        for rank in checks.spared(alone, suspects, middle):
            bad[rank] = False
        alone = [rank for rank in keep if not bad[rank]]
        for rank in checks.spoilers(alone, middle):
            bad[rank] = True
        kept = []
        for rank in keep:
            worker = workers[rank]
            if bad[rank]:
                self._event(round_, step, worker, "bad")
                self._bad(round_, step, worker)
            else:  # any round it is not judged bad in ends its run (see the module doc)
                self.streaks[worker] = 0
                self._judged_good(worker)
            if not bad[rank] and worker not in self.excluded:
                kept.append(rank)
        return kept

    def held_against(self, rows: list[torch.Tensor], keep: list[int]):
        """The aggregate the leave-one-out checks hold contributions against: the mean under a
        per-coordinate rule (which hides one outlier whether it is in or out), else the rule's."""
        if self.aggregate.rule in COORDINATE_RULES:
            return self._mean(rows, keep)
        return self._combine(rows, keep)

    def _judged_good(self, worker: int) -> None:
        window = self.judge.exclude_window
        if window:
            self.verdicts[worker] = [*self.verdicts[worker], 0][-window:]

    def _bad(self, round_: int, step: int, rank: int) -> None:
        self.streaks[rank] += 1
        n = self.judge.exclude_after if self.judge is not None else 0
        window = self.judge.exclude_window if self.judge is not None else None
        if window:
            self.verdicts[rank] = [*self.verdicts[rank], 1][-window:]
        often = bool(window) and sum(self.verdicts[rank]) >= n
        running = n
        if self.judge is not None and self.seen[rank] <= self.judge.probation_rounds:
            running = min(n, 2)  # on probation: see the module doc
        # an honest majority is what any of this rests on: never exclude half the workers
        room = len(self.excluded) < (self.size - 1) // 2
        if n and room and (self.streaks[rank] >= running or often) and rank not in self.excluded:
            self.excluded[rank] = round_
            self._event(round_, step, rank, "excluded")
            if self.streaks[rank] < n and not often:  # only probation's shorter run did it
                self.events[-1]["probation"] = True

    def _event(self, round_: int, step: int, rank: int, why: str) -> None:
        self.events.append({"round": round_, "step": step, "rank": rank, "why": why})

    def record(self) -> dict:
        """What the metrics and the summary say of the rounds so far."""
        return {
            "trust_rounds": self.rounds,
            "excluded": {str(r): at for r, at in sorted(self.excluded.items())},
            "dropped_nonfinite": [
                (e["rank"], e["round"]) for e in self.events if e["why"] == "nonfinite"
            ],
            "judged_bad": [(e["rank"], e["round"]) for e in self.events if e["why"] == "bad"],
        }

    def metrics(self) -> dict:
        """A metrics line's share: the workers excluded so far (rank: round), how many
        contributions were dropped as non-finite or judged bad, and with scoring the last scored
        round's score of each worker's contribution (`trust_scores`, by worker: the loss
        change it caused on the held-out batch; null where it was not finite or not scored)."""
        record = self.record()
        line = {
            "excluded": record["excluded"],
            "dropped_nonfinite": len(record["dropped_nonfinite"]),
            "judged_bad": len(record["judged_bad"]),
        }
        if self.judge is not None:
            line["trust_scores"] = [
                s if s is not None and math.isfinite(s) else None for s in self.scores
            ]
            # how many standard errors each one's held-out losses exceeded the median
            # contribution's by (the paired test of `score_z`; null: not finite or not scored)
            line["trust_z"] = list(self.zs)
        return line

    @staticmethod
    def lines(events: list[dict]) -> list[str]:
        """One line for each dropped non-finite contribution and each exclusion (bad scores
        are counted in the metrics, not announced)."""
        what = {
            "nonfinite": "its contribution held NaN/Inf: dropped from the round",
            "excluded": "excluded: its contributions are dropped from now on",
        }
        return [
            f"trust: worker {e['rank']} at round {e['round']} (step {e['step']}): {what[e['why']]}"
            + (
                " (2 bad rounds running on probation: sync.probation_rounds)"
                if e.get("probation")
                else ""
            )  # fmt: skip
            for e in events
            if e["why"] in what
        ]

    def state_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "streaks": list(self.streaks),
            "verdicts": [list(v) for v in self.verdicts],
            "excluded": dict(self.excluded),
            "events": [dict(e) for e in self.events],
            "scores": list(self.scores),  # what the next metrics line says before a new round
            "zs": list(self.zs),
            "seen": list(self.seen),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.rounds = int(state["rounds"])
        self.streaks = [int(s) for s in state["streaks"]]
        self.size = max(self.size, len(self.streaks))
        saved = state.get("verdicts") or []
        self.verdicts = [[int(x) for x in v] for v in saved]
        self.verdicts += [[] for _ in range(self.size - len(self.verdicts))]
        self.excluded = {int(r): int(at) for r, at in state["excluded"].items()}
        self.events = [dict(e) for e in state["events"]]
        scores = list(state.get("scores") or [])
        self.scores = scores + [None] * (self.size - len(scores))
        zs = list(state.get("zs") or [])
        self.zs = zs + [None] * (self.size - len(zs))
        # a checkpoint from before probation: each worker took part in every round
        seen = [int(x) for x in state.get("seen") or [self.rounds] * len(self.streaks)]
        self.seen = seen + [0] * (self.size - len(seen))

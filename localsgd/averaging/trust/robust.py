"""Aggregating contributions you cannot trust: every rank's contribution gathered, then a
robust rule over them.

A contribution is what one worker proposes to move the model by in a round, its change since
the last sync (`local - anchor`; DiLoCo's pseudo-gradient is its negation). The plain mean
all-reduces them, so one worker's NaN or a change 1000x too large moves every replica. Here
every rank all-gathers the contributions in rank order instead (decoded to fp32 when a
low-precision `comm_dtype` or a top-k message carried them), drops those that are not finite,
and combines the rest with an `Aggregate` rule, one entry of the table `RULES`:

- `mean`: the plain mean, summed in rank order;
- `clip`: each contribution scaled down to at most `clip_multiple` times the round's median
  norm (the norm over the whole contribution), then the mean;
- `trimmed_mean`: per coordinate, the `trim_fraction` largest and smallest values cut, the rest
  summed in sorted order and divided;
- `median`: per coordinate, the middle value (the mean of the two middle ones for an even count);
- `sign`: per coordinate, the sign most contributions sent (a tie: 0), times the round's median
  RMS magnitude (signSGD's majority vote).

Every rank holds the same gathered bytes and runs the same deterministic operations, so every
rank reaches the same bits; `combine` is a plain function of the stacked contributions, so a
one-process reference computes the same bits too (`tests/test_robust.py`). With nothing
dropped, the gathered mean of low-bit or top-k messages has the bits of their decoded mean
(`comm.decode_mean_`), top-k's senders' mean included. A per-coordinate rule (median, trimmed
mean, sign: `COORDINATE_RULES`) is refused over top-k messages (`PER_COORDINATE`). A round with
no contribution left keeps the anchor.

The gather is counted as what this rank sends (its contribution's bytes in the wire format),
the rule every collective here follows (`Communicator.all_gather_`). It receives `size - 1`
times that, where a ring all-reduce moves about twice its buffer: robust aggregation costs
bandwidth on wide groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.finite import all_finite
from localsgd.averaging.wire.compress import feed_back_
from localsgd.averaging.wire.quantize import GatheredWire


@dataclass(frozen=True)
class Aggregate:
    """A rule over the contributions of one round (see the module doc), one of `RULES`."""

    rule: str = "mean"
    clip_multiple: float = 2.0  # clip: the bound, in multiples of the round's median norm
    trim_fraction: float = 0.25  # trimmed_mean: cut from each side, per coordinate

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"aggregate must be one of {', '.join(RULES)}, got {self.rule!r}")
        if not self.clip_multiple > 0:
            raise ValueError(f"clip_multiple must be > 0, got {self.clip_multiple!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")

    @property
    def needs_norms(self) -> bool:
        """Whether the rule reads each contribution's whole norm (reduced across a shard group
        where the rows hold a shard of it: `TrustedRound`)."""
        return RULES[self.rule].needs_norms

    def combine(
        self,
        rows: list[torch.Tensor],
        keep: list[int],
        sent: list | None = None,
        norms: list[float] | None = None,
        numel: int | None = None,
    ) -> list[torch.Tensor] | None:
        """The aggregate of rows `keep` (rank indices, ascending) of each `[size, n]` tensor in
        `rows` (one per flat buffer), as new fp32 tensors; None when `keep` is empty. `sent`
        (one per buffer, None or a bool `[size, >= n]`: where each top-k message held an
        index): the mean and clip divide each index by the kept contributions that sent it
        (`sparse.TopKCodec(mean="senders")`) instead of by their number. `norms`, `numel`: each
        kept contribution's whole norm and the whole contribution's length, where `rows` hold
        only part of it (a shard); None: over `rows`."""
        if not keep:
            return None
        sent = sent or [None] * len(rows)
        if norms is None and self.needs_norms:
            norms = row_norms(rows, keep)
        if numel is None:
            numel = sum(r.shape[1] for r in rows)
        return RULES[self.rule].combine(self, rows, keep, sent, norms, numel)


def _mean(agg: Aggregate, rows, keep, sent, norms, numel) -> list[torch.Tensor]:
    return [
        _sum_in_order([r[i] for i in keep], _divisor(s, keep, r.shape[1]))
        for r, s in zip(rows, sent, strict=True)
    ]


def _clip(agg: Aggregate, rows, keep, sent, norms, numel) -> list[torch.Tensor]:
    scales = clip_scales(rows, keep, agg.clip_multiple, norms)
    out = []
    for r, senders in zip(rows, sent, strict=True):
        acc = r[keep[0]].mul(scales[0])
        for i, s in zip(keep[1:], scales[1:], strict=True):
            acc.add_(r[i].mul(s))
        out.append(acc.div_(_divisor(senders, keep, r.shape[1])))
    return out


def _median(agg: Aggregate, rows, keep, sent, norms, numel) -> list[torch.Tensor]:
    out = []
    for r in rows:
        ordered = r[keep].sort(dim=0).values  # per coordinate, ascending
        k, mid = len(keep), len(keep) // 2
        value = ordered[mid].clone() if k % 2 else ordered[mid - 1].add(ordered[mid])
        out.append(value if k % 2 else value.div_(2))
    return out


def _trimmed_mean(agg: Aggregate, rows, keep, sent, norms, numel) -> list[torch.Tensor]:
    out = []
    for r in rows:
        ordered = r[keep].sort(dim=0).values  # per coordinate, ascending
        k = len(keep)
        cut = math.floor(agg.trim_fraction * k)
        out.append(_sum_in_order(list(ordered[cut : k - cut]), k - 2 * cut))
    return out


def _sign(agg: Aggregate, rows, keep, sent, norms, numel) -> list[torch.Tensor]:
    """signSGD's majority vote (Bernstein et al. 2019; Covenant's signed aggregation): each
    coordinate the sign most kept contributions sent (a tie: 0), times the round's median RMS
    magnitude, the median over the kept contributions of ||x|| / sqrt(n). One worker can move
    a coordinate by one vote of the magnitude the median worker sends, never by its own."""
    scale = median_of([n / math.sqrt(max(numel, 1)) for n in norms])
    out = []
    for r in rows:
        votes = torch.sign(r[keep[0]])
        for i in keep[1:]:
            votes.add_(torch.sign(r[i]))
        out.append(votes.sign_().mul_(scale))
    return out


@dataclass(frozen=True)
class Rule:
    combine: Callable[..., list[torch.Tensor]]
    per_coordinate: bool = False  # a per-coordinate rule hides one outlier in every coordinate
    needs_norms: bool = False


RULES: dict[str, Rule] = {
    "mean": Rule(_mean),
    "clip": Rule(_clip, needs_norms=True),
    "trimmed_mean": Rule(_trimmed_mean, per_coordinate=True),
    "median": Rule(_median, per_coordinate=True),
    "sign": Rule(_sign, per_coordinate=True, needs_norms=True),
}
AGGREGATES = tuple(RULES)
COORDINATE_RULES = tuple(name for name, rule in RULES.items() if rule.per_coordinate)


# why a per-coordinate rule cannot judge sparse contributions
PER_COORDINATE = (
    "most indices hold one worker's value and the others' zeros, so a per-coordinate rule "
    "(median, trimmed mean, sign) discards what was sent (use the mean, with scoring, or clip)"
)


def _divisor(sent: torch.Tensor | None, keep: list[int], n: int) -> int | torch.Tensor:
    """What the sum of rows `keep` is divided by: their number, or per index the number of them
    that sent it (an index none sent: 1, so it stays 0)."""
    if sent is None:
        return len(keep)
    count = sent[keep, :n].sum(0, dtype=torch.float32)
    return count.masked_fill_(count == 0, 1.0)


def _sum_in_order(values: list[torch.Tensor], divisor: int | torch.Tensor) -> torch.Tensor:
    """`(values[0] + values[1] + ...) / divisor`, added one at a time in that order (the bits a
    reference reproduces)."""
    acc = values[0].clone()
    for v in values[1:]:
        acc.add_(v)
    return acc.div_(divisor)


def row_norms(rows: list[torch.Tensor], keep: list[int]) -> list[float]:
    """The norm of each kept contribution over every flat buffer (summed in float64)."""
    return [math.sqrt(sum(float(r[i].double().square().sum()) for r in rows)) for i in keep]


def median_of(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def clip_scales(
    rows: list[torch.Tensor], keep: list[int], multiple: float, norms: list[float] | None = None
) -> list[float]:
    """Each kept contribution's factor: `min(1, multiple * median norm / its norm)` (`norms`:
    the kept ones', when `rows` do not hold them whole)."""
    norms = row_norms(rows, keep) if norms is None else norms
    bound = multiple * median_of(norms)
    return [1.0 if n <= bound else bound / n for n in norms]


def finite_rows(rows: list[torch.Tensor]) -> list[bool]:
    """Whether each rank's contribution is finite in every flat buffer."""
    size = rows[0].shape[0]
    ok = torch.ones(size, dtype=torch.bool, device=rows[0].device)
    for r in rows:
        ok &= torch.isfinite(r).all(dim=1)
    return ok.tolist()


class GatheredContributions:
    """Every rank's contribution, gathered in rank order into fp32 rows (`[size, n]` per flat
    buffer), through the wire buffers `low` (see `compress.wire_buffers`): None sends the
    buffer as it is, a tensor of another dtype casts it, a `QuantizedWire` block-quantises it
    and every message is decoded. With `residuals` (error feedback) `decay` times each is added
    first and each then receives what this rank failed to send, as `lossy_mean_` does."""

    def __init__(self, buffers: list[torch.Tensor], size: int, low: list, decay: float = 1.0):
        self.low = low
        self.decay = decay  # beta of `e <- beta e + d` (compress)
        self.pending: list = []  # a launched gather's collectives (`launch_gather_`)
        self._allocate(buffers, size)

    def _allocate(self, buffers: list[torch.Tensor], size: int) -> None:
        self.size = size
        self.rows = [
            torch.empty(size, b.numel(), dtype=torch.float32, device=b.device) for b in buffers
        ]
        self._cast = [  # the gather buffer of a buffer sent in another dtype
            torch.empty(size * w.numel(), dtype=w.dtype, device=w.device)
            if isinstance(w, torch.Tensor)
            else None
            for w in self.low
        ]
        # a top-k wire with the senders' mean: where each rank's message held an index (the
        # padded length, `SparseWire.mark_sent_`)
        self.sent = [
            torch.zeros(size, w.work.numel(), dtype=torch.bool, device=w.work.device)
            if getattr(w, "senders", None) is not None
            else None
            for w in self.low
        ]

    def launch_gather_(
        self,
        flats: list[torch.Tensor],
        comm: Communicator,
        residuals: list[torch.Tensor | None],
    ) -> GatheredContributions:
        """`gather_`, launched: every buffer is encoded (and its residual taken) now and its
        all-gather started; `wait()` finishes them and decodes the rows. The caller must not
        touch `flats` before `wait()` (what was sent is copied to the wire or gathered from
        it)."""
        if comm.size != self.size:
            self._allocate(flats, comm.size)
        self.pending = []
        for flat, low, rows, cast, residual in zip(
            flats, self.low, self.rows, self._cast, residuals, strict=True
        ):
            feed_back_(flat, residual, self.decay)
            if isinstance(low, GatheredWire):
                low.encode_(flat)
                if residual is not None:
                    residual.copy_(flat).sub_(low.decode(low.send))
                self.pending.append(comm.launch_all_gather_(low.gathered(self.size), low.send))
            elif low is not None:
                low.copy_(flat)
                if residual is not None:
                    torch.sub(flat, low, out=residual)
                self.pending.append(comm.launch_all_gather_(cast, low))
            else:
                if flat.dtype != torch.float32:
                    raise ValueError("a launched gather sends fp32 buffers or a wire format")
                self.pending.append(comm.launch_all_gather_(rows.view(-1), flat))
            if residual is not None and not all_finite([residual]):
                residual.zero_()  # see `gather_`
        return self

    def wait(self) -> list[torch.Tensor]:
        """The rows of the launched gather (`launch_gather_`), decoded (once: a second call
        returns them as they are)."""
        if not self.pending:
            return self.rows
        for pending, low, rows, cast, sent in zip(
            self.pending, self.low, self.rows, self._cast, self.sent, strict=True
        ):
            pending.wait()
            if isinstance(low, GatheredWire):
                gathered, nb = low.gathered(self.size), low.nbytes
                for rank in range(self.size):
                    rows[rank].copy_(low.decode(gathered[rank * nb : (rank + 1) * nb]))
                    if sent is not None:
                        low.mark_sent_(sent[rank])
            elif low is not None:
                rows.view(-1).copy_(cast)
        self.pending = []
        return self.rows

    def gather_(
        self,
        flats: list[torch.Tensor],
        comm: Communicator,
        residuals: list[torch.Tensor | None],
        members: int | None = None,
    ) -> list[torch.Tensor]:
        """One row per member of the gather (`members`, by default the group's size; under
        torchft the quorum's replicas, healing ones included), in the group's order."""
        members = comm.size if members is None else members
        if members != self.size:  # under torchft the quorum changes size
            self._allocate(flats, members)
        for flat, low, rows, cast, sent, residual in zip(
            flats, self.low, self.rows, self._cast, self.sent, residuals, strict=True
        ):
            feed_back_(flat, residual, self.decay)
            if isinstance(low, GatheredWire):  # block-quantised or top-k messages
                low.encode_(flat)
                if residual is not None:
                    residual.copy_(flat).sub_(low.decode(low.send))
                gathered = low.gathered(self.size)
                comm.all_gather_(gathered, low.send)
                nb = low.nbytes
                for rank in range(self.size):
                    rows[rank].copy_(low.decode(gathered[rank * nb : (rank + 1) * nb]))
                    if sent is not None:
                        low.mark_sent_(sent[rank])
            elif low is not None:
                low.copy_(flat)
                if residual is not None:
                    torch.sub(flat, low, out=residual)
                comm.all_gather_(cast, low)
                rows.view(-1).copy_(cast)
            elif flat.dtype == torch.float32:
                comm.all_gather_(rows.view(-1), flat)
            else:  # a buffer of another dtype sent as it is: gathered in it, then widened
                cast = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=flat.device)
                comm.all_gather_(cast, flat)
                rows.view(-1).copy_(cast)
            if residual is not None and not all_finite([residual]):
                # this rank's contribution held NaN/Inf and is dropped from the round; its
                # residual would carry the NaN into every later one (`compress.forget_nonfinite_`)
                residual.zero_()
        return self.rows


def robust_mean_(buffer: torch.Tensor, comm: Communicator, trust) -> None:
    """`buffer` combined over `comm`'s group by a robust round's rule (`trust`, a
    `TrustedRound`: its aggregate), over the workers it has not excluded and whose values
    are finite; kept as it is when none is left (optimizer state, an adaptive period's loss)."""
    workers, live = comm.members()
    rows = torch.empty(len(workers) * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
    comm.all_gather_(rows, buffer)
    rows = rows.view(len(workers), -1).float()
    finite = finite_rows([rows])
    keep = [
        at
        for at, worker in enumerate(workers)
        if live[at] and finite[at] and worker not in trust.excluded
    ]
    result = trust.aggregate.combine([rows], keep)
    if result is not None:
        buffer.copy_(result[0])

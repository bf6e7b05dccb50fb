"""The one object every collective of the averaging core goes through.

A `Communicator` holds a process group, its size, whether the backend averages inside the
reduction, the counters, and the simulated slow link. Plain, hierarchical, compressed, outer
(DiLoCo/SlowMo) and delayed averaging, the warmup's gradient averaging and optimizer-state
averaging all call it, so a simulated link applies to every one of them by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from localsgd.averaging.finite import NonFiniteGuard, all_finite, fuses_division, scale_
from localsgd.averaging.timeouts import default_timeout

# the backend name of `localsgd.averaging.virtual`'s thread group (defined here, where it is read)
VIRTUAL_BACKEND = "virtual"

if TYPE_CHECKING:
    from localsgd.averaging.wire.quantize import QuantizedWire


@dataclass
class CommStats:
    """What one worker communicated. A round is one step at which workers communicated."""

    rounds: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.rounds, self.bytes, self.seconds = (
            int(state["rounds"]),
            int(state["bytes"]),
            float(state["seconds"]),
        )


@dataclass(frozen=True)
class SimulatedLink:
    """A network slower than the real one: every collective lasts at least
    `latency_ms + payload bytes / bandwidth`, the payload being the bytes one worker puts into it.

    The real collective runs first (so results are real); then the caller sleeps whatever is
    left of the simulated time. Only the sleep is simulated, so a link faster than the real
    transport changes nothing. Lets one machine show how a strategy behaves on a 100 Mbit/s or
    cross-continent link.
    """

    bandwidth_gbps: float | None = None  # None: unlimited (latency only)
    latency_ms: float = 0.0

    def __post_init__(self):
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ValueError(
                f"bandwidth_gbps must be > 0 (or None: unlimited), got {self.bandwidth_gbps!r}"
            )
        if not self.latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms!r}")

    def seconds(self, nbytes: int) -> float:
        """How long a collective of `nbytes` per worker takes on this link."""
        transfer = 0.0 if self.bandwidth_gbps is None else nbytes * 8 / (self.bandwidth_gbps * 1e9)
        return self.latency_ms / 1e3 + transfer

    def wait_out(self, start: float, nbytes: int) -> None:
        """Sleep until `start + seconds(nbytes)` (start from `time.perf_counter()`)."""
        left = start + self.seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)


def supports_avg(group: dist.ProcessGroup | None) -> bool:
    """Whether the backend averages inside the reduction: NCCL always, gloo from torch 2.13 on
    (every rank receives the same bits, as with dividing first), and virtual workers as gloo
    does (`localsgd.averaging.virtual`)."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.NCCL:
        return True
    gloo_like = backend in (dist.Backend.GLOO, VIRTUAL_BACKEND)
    return gloo_like and TorchVersion(torch.__version__) >= (2, 13)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingMean:
    """Asynchronous collectives launched by `Communicator.launch_mean_` or
    `launch_quantized_mean_`; `wait()` finishes them (and a simulated link's time), then runs
    `finish` once (copying a low-precision result back, or decoding and averaging the gathered
    messages)."""

    def __init__(
        self,
        comm: Communicator,
        works: list,
        nbytes: int,
        start: float,
        finish: Callable[[], None] | None = None,
    ):
        self.comm, self.works, self.nbytes, self.start = comm, works, nbytes, start
        self.finish = finish

    def wait(self) -> None:
        begin = time.perf_counter()
        for work in self.works:
            work.wait()
        if self.comm.link is not None:
            self.comm.link.wait_out(self.start, self.nbytes)
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.comm.stats.seconds += time.perf_counter() - begin


def parallel_groups(group: dist.ProcessGroup | None) -> list[list[int]]:
    """`group`'s ranks (None: all) and its parallel groups' (sharded replica groups: one per
    shard index), by first rank; one gather over every rank unless it is all of them."""
    world = dist.get_world_size()
    mine = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    if len(mine) == world:
        return [mine]
    everyone: list[list[int]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    return [list(r) for r in sorted({tuple(r) for r in everyone}, key=lambda r: r[0])]


class Communicator:
    """A process group with its size, AVG support, counters (`stats`, shared across levels and
    with the warmup) and an optional simulated link.

    Every method is a collective: every rank of the group must call it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
        guard: bool = True,
    ):
        self.group = group
        self.size = dist.get_world_size(group)
        self.use_avg = supports_avg(group)
        self.stats = stats if stats is not None else CommStats()
        self.link = link
        # a weighted round (`weigh`): this rank's share w_r / sum(w) of the next means; None:
        # the plain mean
        self.share: float | None = None
        self.weights: list[float] | None = None  # every rank's weight, in a weighted round
        # drop a contribution holding NaN/Inf from each mean (`finite.NonFiniteGuard`); the
        # ranks dropped so far are appended to `dropped`, shared with `subgroups`' levels
        self.guard = guard
        self.dropped: list[int] = []

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return dist.get_rank(self.group)

    # every rank of the group takes part in every collective: work can be split among them
    splits_work = True

    def members(self) -> tuple[list[int], list[bool]]:
        """Whose contribution each place of an all-gather over the group holds (the workers'
        indices, here the ranks), and whether it is one (here always: under torchft a replica
        healing in the round is a member whose place holds a copy of a peer's state)."""
        return list(range(self.size)), [True] * self.size

    def weigh(self, weight: float, device: torch.device | None = None) -> list[float]:
        """Every rank's `weight` for the next means (one all-reduce of a vector of one slot per
        rank, in rank order; counted). Unequal weights make `mean_` the weighted mean,
        sum_r (w_r / sum(w)) x_r, until `unweigh()`; equal ones (everyone on time) leave it the
        plain mean, bit for bit. Returns the weights."""
        start = time.perf_counter()
        slots = torch.zeros(self.size, dtype=torch.float64, device=device)
        slots[dist.get_rank(self.group)] = float(weight)
        dist.all_reduce(slots, group=self.group)
        self._account(start, _nbytes(slots))
        weights = slots.tolist()
        total = sum(weights)
        unequal = total > 0 and any(w != weights[0] for w in weights)
        self.share = weight / total if unequal else None
        self.weights = weights if unequal else None
        return weights

    def unweigh(self) -> None:
        self.share = self.weights = None

    def subgroups(self, size: int) -> Communicator:
        """This rank's group of `size` contiguous ranks of this group (as torch's
        `dist.new_subgroups`), sharing the counters and the link. Collective over the default
        group: every rank must call it in the same order."""
        if size == self.size:
            return self
        # every rank must enumerate the same subgroups: the chunks of every rank's group
        every = parallel_groups(self.group)
        chunks = [list(ranks[i : i + size]) for ranks in every for i in range(0, len(ranks), size)]
        group, _ = dist.new_subgroups_by_enumeration(chunks, timeout=default_timeout())
        level = Communicator(group, self.stats, self.link, self.guard)
        level.dropped = self.dropped
        return level

    def mean_(self, flat: torch.Tensor, through: torch.Tensor | None = None) -> None:
        """Replace `flat` in place by its mean over the group, with one all-reduce.

        With AVG the backend divides inside the reduction; otherwise (or where a guarded mean
        checks in the division: `_reduction`) the buffer is divided in place first, as torch's
        `average_parameters` does. Either way every rank gets the same bits. `through`, a
        preallocated buffer of another dtype, carries the communication in that precision.
        """
        start = time.perf_counter()
        wire = flat if through is None else through.copy_(flat)
        multiply, divide, op = self._reduction(self.share, [wire])
        guard = NonFiniteGuard([wire], multiply, divide) if self.guard else None  # checks, scales
        if guard is None:
            scale_([wire], multiply, divide)
        dist.all_reduce(wire, op=op, group=self.group)
        if guard is not None:
            self._settle(guard, self.share)
        if through is not None:
            flat.copy_(wire)
        self._account(start, _nbytes(wire))

    def _reduction(self, share: float | None, wires: list[torch.Tensor]) -> tuple:
        """(multiply, divide, op): a weighted round's share, summed; else the size, summed, where
        the backend cannot average or a guarded round checks in the division
        (`finite.fuses_division`: AVG's bits); else the backend's AVG."""
        if share is not None:
            return share, None, dist.ReduceOp.SUM
        if not self.use_avg or (self.guard and fuses_division(wires, self.size)):
            return None, self.size, dist.ReduceOp.SUM
        return None, None, dist.ReduceOp.AVG

    def _settle(self, guard: NonFiniteGuard, share: float | None) -> None:
        """After a guarded reduction: the mean of the finite contributions (see finite.py);
        `share`: this rank's, in a weighted round."""

        def all_reduce(slots: torch.Tensor) -> None:
            begin = time.perf_counter()
            dist.all_reduce(slots, group=self.group)
            self._account(begin, _nbytes(slots))

        scale = share if share is not None else 1.0 / self.size
        rank = dist.get_rank(self.group)
        self._drop(guard.settle(scale, rank, self.size, all_reduce))

    def _drop(self, ranks: list[int]) -> None:
        """Name the dropped ranks by their global rank."""
        if self.group is not None:
            ranks = [dist.get_global_rank(self.group, r) for r in ranks]
        self.dropped.extend(ranks)

    def launch_mean_(
        self, pieces: list[torch.Tensor], through: list[torch.Tensor] | None = None
    ) -> PendingMean:
        """Start averaging each of `pieces` in place, asynchronously, one all-reduce each; the
        caller must `wait()` the result before reading them. `through`, one preallocated buffer
        of another dtype per piece, carries the communication in that precision (bytes counted
        at it), exactly as `mean_(piece, through=...)` does: the same bits. A weighted round's
        shares are the ones set at the launch."""
        start = time.perf_counter()
        share = self.share  # a weighted round may end (`unweigh`) before the wait
        wires = pieces if through is None else [
            t.copy_(p) for t, p in zip(through, pieces, strict=True)
        ]  # fmt: skip
        multiply, divide, op = self._reduction(share, wires)
        # one verdict for the set (dropped from every piece or none), checked as it is scaled
        guard = NonFiniteGuard(wires, multiply, divide) if self.guard else None
        works = []
        for wire in wires:
            if guard is None:  # unguarded: scaled one piece at a time, its transfer then started
                scale_([wire], multiply, divide)
            works.append(dist.all_reduce(wire, op=op, group=self.group, async_op=True))
        nbytes = sum(_nbytes(w) for w in wires)
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - start

        def finish() -> None:
            if guard is not None:
                self._settle(guard, share)
            if through is not None:
                for piece, wire in zip(pieces, wires, strict=True):
                    piece.copy_(wire)

        return PendingMean(self, works, nbytes, start, finish)

    def launch_quantized_mean_(
        self,
        pieces: list[torch.Tensor],
        wires: list[QuantizedWire],
        residuals: list[torch.Tensor | None] | None = None,
    ) -> PendingMean:
        """`quantized_mean_` of each of `pieces`, asynchronously: every piece is encoded now and
        its message's all-gather launched; `wait()` decodes the gathered messages and averages
        them in fp32 in rank order into the piece, the same bits as `quantized_mean_`. The
        caller must not touch `pieces` or `wires` before `wait()`. Counted as the messages'
        bytes (payload plus scales); a simulated link's time is waited out at `wait()`, only for
        what is left. `residuals` (error feedback) as in `quantized_mean_`, filled at launch."""
        start = time.perf_counter()
        residuals = residuals if residuals is not None else [None] * len(pieces)
        weights = self.weights  # a weighted round's, as set at the launch
        works = []
        for piece, wire, residual in zip(pieces, wires, residuals, strict=True):
            wire.encode_(piece)
            if residual is not None:
                residual.copy_(piece).sub_(wire.decode(wire.send))
            gathered = wire.gathered(self.size)
            works.append(_gather_into(gathered, wire.send, self.group, async_op=True))
        nbytes = sum(w.nbytes for w in wires)
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - start

        def decode() -> None:
            for piece, wire in zip(pieces, wires, strict=True):
                self._average_gathered(piece, wire, weights)

        return PendingMean(self, works, nbytes, start, decode)

    def broadcast_(self, flat: torch.Tensor, src: int = 0) -> None:
        """Every rank gets rank `src`'s `flat` (`src` counted within the group, e.g. the first
        rank of a replica group; setup, not training communication: not counted, and not slowed
        by the link)."""
        if self.group is None:
            dist.broadcast(flat, src=src)
        else:
            dist.broadcast(flat, group=self.group, group_src=src)

    def _account(self, start: float, nbytes: int) -> None:
        if self.link is not None:
            self.link.wait_out(start, nbytes)
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - start

    def all_gather_(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every rank's `inp` into `out` (`size * inp.numel()` elements, rank r's at
        `[r * inp.numel():]`), with one all-gather; counted as `inp`'s bytes (what this rank
        sends) and slowed by the link like every other collective."""
        start = time.perf_counter()
        _gather_into(out, inp, self.group)
        self._account(start, _nbytes(inp))

    def launch_all_gather_(self, out: torch.Tensor, inp: torch.Tensor) -> PendingMean:
        """`all_gather_`, launched: `wait()` the handle before reading `out` (counted as
        `inp`'s bytes; a simulated link's time is waited out at `wait()`)."""
        start = time.perf_counter()
        work = _gather_into(out, inp, self.group, async_op=True)
        self.stats.bytes += _nbytes(inp)
        self.stats.seconds += time.perf_counter() - start
        return PendingMean(self, [work], _nbytes(inp), start)

    def quantized_mean_(
        self, flat: torch.Tensor, wire: QuantizedWire, residual: torch.Tensor | None = None
    ) -> None:
        """Replace `flat` by the mean over the group of every rank's quantised `flat`.

        `wire` (a `localsgd.averaging.wire.quantize.QuantizedWire` for `flat.numel()` values) holds
        the preallocated buffers. Each rank encodes its `flat`; the messages (payload plus
        scales, uint8) are all-gathered, since integers cannot be summed in a reduction; then
        every rank decodes them all and sums them in fp32 in rank order, so every rank gets the
        same bits. Counted as the message's bytes. With `residual` (error feedback), it receives
        `flat - (the value this rank's message decodes to)`: what this rank failed to send.
        """
        start = time.perf_counter()
        wire.encode_(flat)
        if residual is not None:
            residual.copy_(flat).sub_(wire.decode(wire.send))
        _gather_into(wire.gathered(self.size), wire.send, self.group)
        self._average_gathered(flat, wire, self.weights)
        self._account(start, wire.nbytes)

    def _average_gathered(
        self, flat: torch.Tensor, wire: QuantizedWire, weights: list[float] | None
    ) -> None:
        gathered = wire.gathered(self.size)
        self._drop(decode_mean_(flat, wire, gathered, self.size, self.size, self.guard, weights))


def decode_mean_(
    flat: torch.Tensor,
    wire: QuantizedWire,
    gathered: torch.Tensor,
    members: int,
    divisor: int,
    guard: bool = False,
    weights: list[float] | None = None,
) -> list[int]:
    """`flat` <- the fp32 sum of the first `members` messages in `gathered`, decoded and summed
    in rank order (the same bits on every rank), divided by `divisor`. With `guard`, a message
    that decodes to NaN/Inf is left out and the divisor shrinks by one for each: every rank
    decodes the same messages, so they all drop the same ones, with no communication. With
    `weights` (one per member: a weighted round), each message is scaled by its weight and the
    sum divided by the weights' sum over the messages kept. A top-k wire with the senders' mean
    (`sparse.TopKCodec(mean="senders")`) divides each index instead by the count (or weight) of
    the kept messages that sent it. Returns the ranks left out."""
    acc = wire.accumulator(flat)
    # top-k with mean="senders": each index divided by the (weight of the) messages holding it
    senders = getattr(wire, "senders", None) is not None
    dropped, summed, total = [], 0, 0.0
    for rank in range(members):
        value = wire.decode(gathered[rank * wire.nbytes : (rank + 1) * wire.nbytes])
        if guard and not all_finite([value]):
            dropped.append(rank)
            continue
        if senders:
            wire.count_senders_(summed == 0, 1.0 if weights is None else weights[rank])
        if weights is not None:
            value = value * weights[rank]
            total += weights[rank]
        if summed == 0:
            acc.copy_(value)
        else:
            acc.add_(value)
        summed += 1
    if summed == 0 and members:
        raise RuntimeError(
            "every worker's contribution to this average held NaN or Inf: there is nothing "
            "finite to average (sync.drop_nonfinite)"
        )
    if senders:
        wire.divide_by_senders_(acc)
    elif weights is not None:
        if total == 0:
            raise RuntimeError("every finite contribution to this average weighed nothing")
        acc.div_(total)
    else:
        acc.div_(max(divisor - len(dropped), 1))
    if acc is not flat:
        flat.copy_(acc)
    return dropped


def _gather_into(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
):
    # torch 2.13 renamed all_gather_into_tensor (gloo and NCCL both have it) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)

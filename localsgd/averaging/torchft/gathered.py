"""The gathered collectives of a round across replica groups (`TorchftCommunicator`'s): the
block-quantised mean, whose messages are all-gathered through the Manager's process group and
decoded in rank order as `Communicator.quantized_mean_` does; the all-gather of gathered
contributions (`localsgd.averaging.trust.trusted_round`) with the members it holds; and the weights
of a weighted round (per-worker step counts). A mixin over the communicator's round state
(`in_round`, `live`, `lost`, `manager`, `window_s`, `local`, `stats`); torchft is imported only
inside functions that need it.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from localsgd.averaging.comm import PendingMean, _nbytes, decode_mean_


class _RoundWork:
    """A collective of a round, launched on the Manager's process group: its failure is reported
    to the Manager (the round then does not commit) instead of raised, and its wait is timed for
    the grace window (`TorchftCommunicator.grace`)."""

    def __init__(self, comm, work, window_s: float | None = None):  # comm: TorchftCommunicator
        self.comm, self.work, self.window_s = comm, work, window_s

    def wait(self) -> None:
        if self.work is None:
            return
        begin = time.perf_counter()
        try:
            with self.comm.gate.waiting():  # no stall while a collective waits its timeout
                self.work.wait()
        except Exception as e:
            self.comm._collective_failed(e, time.perf_counter() - begin, self.window_s)
        else:
            self.comm._collective_done(time.perf_counter() - begin, self.window_s)
        self.work = None


def trailing_index(manager) -> int:
    replica_id = str(getattr(manager, "_replica_id", "") or "").split(":")[0]
    digits = re.search(r"(\d+)$", replica_id)
    return int(digits.group(1)) if digits else 0


class GatheredCollectives:
    """What `TorchftCommunicator` gathers, weighs and decodes inside a round (see the module
    doc)."""

    # a healing member evaluates nothing of its own (`TrustedRound`: every replica evaluates)
    splits_work = False

    def weigh(self, weight: float, device: torch.device | None = None) -> list[float]:
        """`Communicator.weigh` across replica groups, inside a round: one SUM all-reduce
        through the Manager of a vector with one slot per member of the quorum (its
        participating rank), in which each live replica writes its `weight` and a healing one
        0 (its contribution is zeros). Unequal weights make the next means `sum_r (w_r /
        sum(w)) x_r` until `unweigh()`; with every live weight equal the means stay the plain
        mean over the live replicas, bit for bit. A replica group of several processes is
        refused (its members' weights would need their own round inside the group)."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.weigh outside a round (begin()/commit())")
        if self.local is not None:
            raise ValueError(
                "weighted rounds through torchft need replica groups of one process each"
            )
        start = time.perf_counter()
        members = self.manager.num_participants()
        slots = torch.zeros(members, dtype=torch.float64, device=self._count.device)
        rank = self.manager.participating_rank()
        if self.live and rank is not None and rank < members:
            slots[rank] = float(weight)
        self.share = self.weights = None
        if self.lost or self.manager.errored() is not None:
            return []  # the round will not commit
        self._allreduce(slots, dist.ReduceOp.SUM).wait()
        self._account(start, _nbytes(slots))
        if self.manager.errored() is not None:
            return []
        weights = slots.tolist()
        given = [w for w in weights if w > 0]
        total = sum(given)
        unequal = bool(given) and (
            any(w != given[0] for w in given) or len(given) != self.participants
        )
        if total > 0 and unequal:
            self.share = weights[rank] / total if self.live and rank is not None else 0.0
            self.weights = weights
        return weights

    def members(self) -> tuple[list[int], list[bool]]:
        """`Communicator.members` across replica groups, inside a round: one all-gather through
        the Manager of each member's worker index and whether it is live (a replica healing
        in this round holds a copy of a peer's state, not a contribution of its own), in the
        order every all-gather of the round follows. After an error the round will not commit:
        every place reads as not live."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.members outside a round (begin()/commit())")
        if self.local is not None:
            raise ValueError("gathered contributions through torchft need replica groups of one "
                             "process each")  # fmt: skip
        count = self.manager.num_participants()
        mine = torch.tensor([float(self.worker), float(self.live)], dtype=torch.float64,
                            device=self._count.device)  # fmt: skip
        everyone = torch.zeros(2 * count, dtype=torch.float64, device=mine.device)
        if not self.lost and self.manager.errored() is None:
            self.all_gather_(everyone, mine)
        if self.manager.errored() is not None or self.lost:
            return list(range(count)), [False] * count
        pairs = everyone.view(count, 2).tolist()
        return [int(w) for w, _ in pairs], [live > 0 for _, live in pairs]

    def all_gather_(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Every member's `inp` into `out`, in the round's order (`members`), through the
        Manager's process group, with the round's grace window; counted as `inp`'s bytes. After
        an error `out` holds anything: the round will not commit."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.all_gather_ outside a round")
        start = time.perf_counter()
        if not self.lost and self.manager.errored() is None:
            _RoundWork(self, self._all_gather(out, inp), self.window_s).wait()
        self._account(start, _nbytes(inp))

    def quantized_mean_(self, flat: torch.Tensor, wire, residual: torch.Tensor | None = None):
        """`Communicator.quantized_mean_` across replica groups: the messages (this group's,
        all-gathered inside it first) are all-gathered through the Manager's process group in
        replica-rank order, i.e. in global rank order, then decoded and summed in that order
        and divided by the live workers. A replica healing in this round sends a message that
        decodes to zeros and keeps its residual (a peer's, just received)."""
        start = time.perf_counter()
        members, gathered, mine = self._encode(flat, wire, residual)
        if gathered is not None:
            _RoundWork(self, self._all_gather(gathered, mine), self.window_s).wait()
            self._decode_mean(flat, wire, gathered, members)
        self._account(start, wire.nbytes)

    def launch_quantized_mean_(self, pieces, wires, residuals=None) -> PendingMean:
        """`quantized_mean_` of each piece, the all-gathers launched now and decoded at
        `wait()` (the same bits)."""
        start = time.perf_counter()
        residuals = residuals if residuals is not None else [None] * len(pieces)
        works, todo = [], []
        for piece, wire, residual in zip(pieces, wires, residuals, strict=True):
            members, gathered, mine = self._encode(piece, wire, residual)
            if gathered is not None:
                works.append(_RoundWork(self, self._all_gather(gathered, mine), self.window_s))
                todo.append((piece, wire, gathered, members))
        nbytes = sum(w.nbytes for w in wires)
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - start

        def finish() -> None:
            for piece, wire, gathered, members in todo:
                self._decode_mean(piece, wire, gathered, members)

        return PendingMean(self, works, nbytes, start, finish)

    def _encode(self, flat: torch.Tensor, wire, residual: torch.Tensor | None):
        """Encode this replica's message (and, under torchrun, gather its group's): returns
        the number of messages the round gathers, their buffer (None after an error) and
        what this replica group sends."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator: a quantised mean outside a round")
        if self.live:
            wire.encode_(flat)
            if residual is not None:
                residual.copy_(flat).sub_(wire.decode(wire.send))
        else:
            wire.encode_(torch.zeros_like(flat))
        mine, per_group = wire.send, 1
        if self.local is not None:
            per_group = self.local.size
            mine = torch.empty(per_group * wire.nbytes, dtype=torch.uint8, device=flat.device)
            counted = (self.stats.bytes, self.stats.seconds)
            self.local.all_gather_(mine, wire.send)
            self.stats.bytes, self.stats.seconds = counted  # counted once, by the caller
        if self.lost or self.manager.errored() is not None:
            return 0, None, mine
        members = self.manager.num_participants() * per_group  # healers' messages too
        gathered = torch.empty(members * wire.nbytes, dtype=torch.uint8, device=flat.device)
        return members, gathered, mine

    def _decode_mean(self, flat: torch.Tensor, wire, gathered: torch.Tensor, members: int):
        if self.manager.errored() is not None:
            return  # the round will not commit
        # healers' messages decode to zeros: summed, but the live workers divide
        self.dropped.extend(
            decode_mean_(flat, wire, gathered, members, self.size, self.guard, self.weights)
        )

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        # the Manager has no all-gather: its process group's, with errors reported to it so
        # that the round does not commit
        from torch.distributed.distributed_c10d import AllgatherOptions

        pg, opts = self.manager._pg, AllgatherOptions()
        if self.grace is not None and self.window_s is not None:
            opts.timeout = timedelta(seconds=self.window_s)
        try:
            return pg.allgather_into_tensor_coalesced([out], [inp], opts)
        except Exception as e:
            self.manager.report_error(e)
            return None

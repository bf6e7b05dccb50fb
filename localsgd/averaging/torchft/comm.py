"""The widest level of an averager, across replica groups, through a torchft Manager.

`TorchftCommunicator` is a `Communicator` whose collectives are torchft's, inside a round that
`localsgd.averaging.torchft.FaultTolerantRounds` drives (`begin()`: the quorum and the
count of live replica groups; `commit()`: `should_commit()`). An average is one SUM all-reduce of
the flat buffer through `manager.allreduce`, divided as the plain `Communicator` divides; a
block-quantised average all-gathers the messages through the Manager's process group and
decodes them in rank order, as `Communicator.quantized_mean_` does. With no fault both give the
torch.distributed path's bits. The gathered collectives (block-quantised means, gathered
contributions and their members, a weighted round's weights) are `gathered.GatheredCollectives`,
a mixin of this class. torchft is imported only inside functions that need it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from localsgd.averaging.comm import (
    CommStats,
    Communicator,
    PendingMean,
    SimulatedLink,
    _nbytes,
)
from localsgd.averaging.torchft.gathered import GatheredCollectives, _RoundWork, trailing_index
from localsgd.averaging.torchft.grace import GraceWindow
from localsgd.averaging.torchft.heartbeat_gate import HeartbeatGate, Ungated

__all__ = ["QuorumLost", "TorchftCommunicator"]


class QuorumLost(RuntimeError):
    """No quorum of enough live replica groups formed within the quorum timeout."""


def _sum_then_divide(local: Communicator | None) -> bool:
    """Divide as the plain path would: where the backend averages inside the reduction (gloo
    from torch 2.13, NCCL) it sums then divides (measured bit-identical to gloo's AVG), so we
    do too; else the plain path divides first, and so do we."""
    if local is not None:
        return local.use_avg
    if torch.cuda.is_available():
        return True
    return TorchVersion(torch.__version__) >= (2, 13)


def _someone_heals(manager) -> bool:
    """Whether a replica group of this round's quorum loads a peer's state: fewer replicas are at
    the quorum's highest step than in the quorum (`make_manager` keeps the last quorum)."""
    quorum = getattr(manager, "localsgd_quorum", None)
    return quorum is not None and quorum.max_world_size < quorum.replica_world_size


class TorchftCommunicator(GatheredCollectives, Communicator):
    """The widest level of an averager, across replica groups, through a torchft Manager.

    `local`, the communicator of this replica group (torch.distributed, size > 1 when the
    group has several processes), is averaged first; then the groups average through
    `manager.allreduce`. Collectives happen only inside a round (`begin()` ... `commit()`),
    which `FaultTolerantRounds` drives. `participants` is the number of replica groups the
    last average included; `size` the number of workers. `device`: where the averaged tensors
    live (the Manager's process group is NCCL's on CUDA, `make_manager(device=...)`), so the
    round's own small all-reduce goes there too.

    `grace`: the timeout of each collective of a round (`GraceWindow`); when it passes, the
    collective fails (gloo closes its connections: nothing is waited out), the round fails and
    is rolled back like a round with a dead peer. None: the process group's own timeout
    (`ft.timeout_s`). An adaptive window is agreed in each round's count: every member waits
    the largest of their proposals. A round in which a replica heals waits for the heal with
    the process group's timeout: a heal takes as long as the state takes to fetch. `timeouts`
    counts the rounds whose window ran out on this replica, `waited_s` the seconds their
    collectives waited.

    `gate`: this worker's `HeartbeatGate` (it heartbeats to the lighthouse only while healthy):
    told of every quorum request, collective wait, success and failure of a round here.
    """

    def __init__(
        self,
        manager,
        *,
        local: Communicator | None = None,
        stats: CommStats | None = None,
        link: SimulatedLink | None = None,
        replicas: int = 1,
        device: torch.device | str = "cpu",
        grace: GraceWindow | None = None,
        guard: bool = True,
        worker: int | None = None,
        gate: HeartbeatGate | None = None,
    ):
        self.manager = manager
        self.gate = gate if gate is not None else Ungated()
        # this replica's worker index (`members`): given, or the trailing digits of its
        # replica id (replica_003 -> 3)
        self.worker = worker if worker is not None else trailing_index(manager)
        # low-bit messages that decode to NaN/Inf are left out of the mean (`decode_mean_`);
        # the Manager's all-reduce of a full-precision mean has no such guard (see mean_)
        self.guard = guard
        self.dropped: list[int] = []
        self.grace = grace
        self.window_s: float | None = None  # this round's per-collective timeout
        self.longest_s = 0.0  # this round's longest collective (what the window learns from)
        self.ran_out = False  # a collective of this round waited its whole window
        self.timeouts = 0  # rounds whose window ran out
        self.waited_s = 0.0  # seconds their collectives waited
        self._members_ran_out: int | None = None  # the quorum's size when the window ran out
        self.local = local if local is not None and local.size > 1 else None
        self.group = None
        self.stats = stats if stats is not None else CommStats()
        self.link = link
        self.use_avg = False  # the division is ours (see mean_)
        # a weighted round (`weigh`): this replica's share of the next means, every member's
        # weight; None: the plain mean over the live replicas
        self.share: float | None = None
        self.weights: list[float] | None = None
        self.sum_first = _sum_then_divide(self.local)
        self.participants = replicas  # replica groups in the last average
        self.live = True  # this replica contributes to this round's average
        self.healed = False  # this replica loaded a peer's state in this round
        self.healers = 0  # replica groups of this round's quorum that loaded a peer's state
        self.in_round = False
        self.lost = False  # no quorum formed this round: nothing goes on the wire
        self.stop_requested = False  # a replica of the last round asked to stop
        self.round_samples = 0  # samples the live replicas trained on since their last round
        self.merged_samples = 0  # their sum over the committed rounds (goodput's numerator)
        # live (1 or 0), stop (1 or 0), samples and (adaptive window) each member's proposed
        # window: one all-reduce per round, on the wire's device (a round's samples stay far
        # below float32's 2**24 exact integers)
        self._count = torch.zeros(3, device=device)

    @property
    def size(self) -> int:
        return self.participants * (self.local.size if self.local is not None else 1)

    def subgroups(self, size: int) -> Communicator:
        raise ValueError(
            "the torchft communicator spans replica groups: build inner levels from the "
            "replica group's own torch.distributed communicator"
        )

    def begin(self, stop: bool = False, samples: int = 0) -> bool:
        """Start a round: the quorum (and a heal, if this replica is behind), then the count of
        live participants, which also carries `stop` (this replica was asked to stop:
        `stop_requested` then says, on every replica of the round, that one was) and `samples`,
        what this replica trained on since its last round (a healed one's count is 0: its own
        work was replaced); a committed round adds their sum to `merged_samples`. With an
        adaptive window it also carries each member's proposed window, and every member takes
        the largest for the rest of the round and the next round's count (`GraceWindow.agree`):
        the count itself waits the window the last round agreed on. Returns whether this
        replica healed."""
        self.healed = False
        self.in_round = True
        self.lost = False
        self.longest_s, self.ran_out, self.window_s = 0.0, False, None
        try:
            with self.gate.quorum_request():  # never closed inside one
                self.manager.start_quorum()
        except Exception as e:  # the quorum's timeout, or the lighthouse gone
            self.lost = True
            raise QuorumLost(f"no quorum: {type(e).__name__}") from e
        agreeing = self.grace is not None and self.grace.adaptive
        if self.grace is not None:
            if self._members_ran_out is not None:
                same = self.manager.num_participants() == self._members_ran_out
                self.grace.next_quorum(same_members=same)
                self._members_ran_out = None
            # the window the last round agreed on: the same on every member of that round
            self.window_s = self.grace.seconds()
        self.gate.in_round(self.window_s)  # how long its peers wait for it in this round
        self.live = not self.healed and self.manager.errored() is None
        count = self._round_count(agreeing)
        count[0] = 1.0 if self.live else 0.0
        count[1] = 1.0 if stop else 0.0
        count[2] = float(samples) if self.live else 0.0
        self.round_samples = 0
        # the count is the barrier after a heal: it waits for the healer with the group's timeout
        heal = _someone_heals(self.manager)
        self._allreduce(count, dist.ReduceOp.SUM, whole_timeout=heal).wait()
        if self.manager.errored() is None:
            self.participants = int(round(count[0].item()))
            self.healers = max(0, self.manager.num_participants() - self.participants)
            self.stop_requested = count[1].item() > 0
            self.round_samples = int(round(count[2].item()))
            largest = count[3:].max().item() if agreeing and count.numel() > 3 else 0.0
            if largest > 0:  # the members' proposals arrived: each takes the largest
                self.grace.agree(largest)
                self.window_s = self.grace.seconds()
        return self.healed

    def _round_count(self, agreeing: bool) -> torch.Tensor:
        """The count all-reduce's tensor: live, stop, samples and, with an adaptive window, one
        slot per member of the round, where each writes its proposed window in its own (a SUM
        of one value and zeros is exact: every member reads every proposal)."""
        members = self.manager.num_participants() if agreeing else 0
        if self._count.numel() != 3 + members:
            self._count = torch.zeros(3 + members, device=self._count.device)
        self._count.zero_()
        rank = self.manager.participating_rank() if agreeing else None
        if rank is not None and rank < members:
            self._count[3 + rank] = self.grace.proposal()
        return self._count

    def commit(self) -> bool:
        """End the round: True when every replica group may keep its result."""
        self.in_round = False
        self.gate.in_round(None)
        if self.lost:
            return False
        ok = bool(self.manager.should_commit() and self.participants > 0)
        if ok:
            self.merged_samples += self.round_samples
            self.gate.progress()
        elif self.manager.errored() is not None:
            self.gate.failed("a collective of its round failed")
        if self.grace is not None:
            if ok:
                self.grace.committed(self.longest_s)
            elif self.ran_out:
                self.grace.ran_out(self.window_s)
                self._members_ran_out = self.manager.num_participants()
                self.timeouts += 1
        return ok

    def _allreduce(self, tensor: torch.Tensor, op, whole_timeout: bool = False):
        """One all-reduce of the round through the Manager's process group, with this round's
        grace window as its timeout (torchft's `Manager.allreduce` takes none: its ops wait
        `ft.timeout_s`). `whole_timeout`: the process group's own timeout instead."""
        if self.grace is None:
            work = self.manager.allreduce(tensor, reduce_op=op)
            return work if isinstance(self.gate, Ungated) else _RoundWork(self, work)
        from torch.distributed.distributed_c10d import AllreduceOptions

        if self.manager.errored() is not None:
            return _RoundWork(self, None)  # the round will not commit: nothing more is sent
        self.manager.wait_quorum()
        opts = AllreduceOptions()
        opts.reduceOp = op
        window = None if whole_timeout else self.window_s
        if window is not None:
            opts.timeout = timedelta(seconds=window)
        try:
            work = self.manager._pg.allreduce([tensor], opts)
        except Exception as e:
            self.manager.report_error(e)
            work = None
        return _RoundWork(self, work, window)

    def _collective_done(self, seconds: float, window_s: float | None) -> None:
        if window_s is not None:  # a heal's wait says nothing of the collectives' time
            self.longest_s = max(self.longest_s, seconds)
        if self.manager.errored() is None:
            self.gate.progress()

    def _collective_failed(self, error: Exception, seconds: float, window_s: float | None):
        """A collective failed: the round will not commit. Where it waited out its window (a
        launched collective's clock started at its launch, so gloo's own word counts too), a
        peer is frozen or slow: counted in `timeouts`/`waited_s` at the commit."""
        self.manager.report_error(error)
        self.gate.failed(f"a collective failed ({type(error).__name__})")
        timed_out = "timed out" in str(error).lower() or (
            window_s is not None and seconds >= 0.95 * window_s
        )
        if window_s is not None and timed_out:
            self.ran_out = True
            self.waited_s += seconds

    def mean_(self, flat: torch.Tensor, through: torch.Tensor | None = None) -> None:
        """Replace `flat` by its mean over the live workers: one SUM all-reduce of the flat
        buffer, divided as the plain `Communicator` divides. After an error the buffer may hold
        anything: the round will not commit, and the caller rolls back."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.mean_ outside a round (begin()/commit())")
        start = time.perf_counter()
        if self.local is not None:
            counted = (self.stats.bytes, self.stats.seconds)
            self.local.mean_(flat, through)
            self.stats.bytes, self.stats.seconds = counted  # the whole mean is counted below
        wire = flat if through is None else through.copy_(flat)
        if not self.lost and self.manager.errored() is None:
            n = max(self.participants, 1)
            if not self.live:
                wire.zero_()
            if self.share is not None:  # a weighted round: each replica's share, summed
                wire.mul_(self.share)
            elif not self.sum_first:
                wire.div_(n)
            self._allreduce(wire, dist.ReduceOp.SUM).wait()
            if self.sum_first and self.share is None and self.manager.errored() is None:
                wire.div_(n)
            if through is not None:
                flat.copy_(wire)
        self._account(start, _nbytes(wire))

    def sum_(self, value: torch.Tensor) -> bool:
        """Inside a round: replace a small tensor by its sum over the round's live replica
        groups (a replica that healed in it adds zeros), blocking: no collective may outlive its
        round. A measurement beside the average (the replicas' drift), so neither counted in
        `stats` nor weighted. False where nothing was summed: no quorum, or a collective of the
        round failed (it will not commit)."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.sum_ outside a round (begin()/commit())")
        if self.lost or self.manager.errored() is not None:
            return False
        if not self.live:
            value.zero_()
        self._allreduce(value, dist.ReduceOp.SUM).wait()
        return self.manager.errored() is None

    def identical(self, tensors: list[torch.Tensor]) -> bool:
        """Inside a round: whether every replica group holds bit-identical `tensors` (two MAX
        all-reduces per tensor: the element-wise maximum and minimum agree everywhere). True
        after an error: the round will not commit and is rolled back anyway."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.identical outside a round")
        if self.lost:
            return True  # the round is rolled back
        for t in tensors:
            high, low = t.detach().clone(), t.detach().neg()
            for x in (high, low):
                self._allreduce(x, dist.ReduceOp.MAX).wait()
            if self.manager.errored() is not None:
                return True
            if not torch.equal(high, low.neg_()):
                return False
        return True

    def launch_mean_(self, pieces: list[torch.Tensor], through=None) -> PendingMean:
        """`mean_` of each piece, the SUM all-reduces launched now through the Manager and
        divided at `wait()` (the same bits as blocking)."""
        if not self.in_round:
            raise RuntimeError("TorchftCommunicator.launch_mean_ outside a round")
        start = time.perf_counter()
        if self.local is not None:
            # inside the group in the wire's precision, as `mean_` does: launched and blocking
            # averages give the same bits
            counted = (self.stats.bytes, self.stats.seconds)
            for piece, wire in zip(pieces, through or pieces, strict=True):
                self.local.mean_(piece, None if wire is piece else wire)
            self.stats.bytes, self.stats.seconds = counted  # counted below, once
        wires = pieces if through is None else [
            t.copy_(p) for t, p in zip(through, pieces, strict=True)
        ]  # fmt: skip
        n, works, share = max(self.participants, 1), [], self.share
        for wire in wires:
            if not self.live:
                wire.zero_()
            if share is not None:
                wire.mul_(share)
            elif not self.sum_first:
                wire.div_(n)
            if not self.lost and self.manager.errored() is None:
                works.append(self._allreduce(wire, dist.ReduceOp.SUM))
        nbytes = sum(_nbytes(w) for w in wires)
        self.stats.bytes += nbytes
        self.stats.seconds += time.perf_counter() - start

        def finish() -> None:
            if self.manager.errored() is not None:
                return
            for piece, wire in zip(pieces, wires, strict=True):
                if self.sum_first and share is None:
                    wire.div_(n)
                if wire is not piece:
                    piece.copy_(wire)

        return PendingMean(self, works, nbytes, start, finish)

    def broadcast_(self, flat: torch.Tensor, src: int = 0) -> None:
        """Inside the replica group only: across groups replicas start identical (seeded), or
        heal from a peer (`make_manager(init_sync=True)`)."""
        if self.local is not None:
            self.local.broadcast_(flat, src)

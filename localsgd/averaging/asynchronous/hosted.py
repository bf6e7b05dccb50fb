"""The syncer in a process that trains nothing (`HostedSyncer`): under `ft=torchft` it runs in the
launcher, beside torchft's lighthouse, so that no worker's death takes the global model with it.

Workers come and go through sessions (`links.Sessions`): a killed worker's process is restarted
by the launcher and joins again, a frozen one is simply not heard from, one cut off from the
syncer finds its session failed and rejoins (`rejoin`). Nobody waits for a worker that is away:
the merges take whoever has sent (`sync.min_quorum`, `sync.grace_s`), and only a meeting (a
checkpoint step, the last step) waits for the others, one transfer's deadline at most
(`end_wait_s`): it is held without a worker still behind then, which meets alone when it gets
there. A meeting's answers name the worker that writes the checkpoint (the first there), whom
the syncer sends its state (`trees.tree_as_json`), and whether the run stops there (a worker there
asked to: SIGTERM, Ctrl-C).

The syncer is built when the first worker joins, from what that worker sends: the model's
layout and the outer step's settings (`rejoin.spec`, json: nothing is unpickled from the
network), its model, which is every worker's at the start, and, resumed from a checkpoint, the
syncer's state the checkpoint holds.
"""

from __future__ import annotations

import time

import torch

from localsgd.averaging.asynchronous.delayed_nesterov import DelayedNesterov
from localsgd.averaging.asynchronous.fleet_period import FleetPeriod
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.asynchronous.links import Sessions
from localsgd.averaging.asynchronous.messages import Decoders, part_decoders
from localsgd.averaging.asynchronous.service import (
    ANNOUNCE,
    LINK_ERRORS,
    MEET,
    SEND,
    TAG_VALUES,
    SyncerService,
)
from localsgd.averaging.asynchronous.syncer import Syncer
from localsgd.averaging.checksum import replica_checksum
from localsgd.averaging.comm import SimulatedLink
from localsgd.averaging.trees import tree_as_json, tree_from_json
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.wire.compress import comm_dtype_of
from localsgd.averaging.wire.sparse import TopKCodec


class HostedSyncer:
    """`workers` workers; `min_quorum`, `grace_s`: when it merges; `host`: the interface its
    store binds to; `transfer_timeout_s`: how long one transfer with a worker may take before
    that worker's session is dropped (it holds every other worker that long); `timeout_s`:
    how long the syncer waits with no message from any worker before it fails; `simulated`:
    a slow link its transfers take as long as (`comm.simulate`, `links.Slowed`)."""

    def __init__(
        self,
        workers: int,
        *,
        min_quorum: int = 1,
        grace_s: float | None = 0.0,
        host: str = "127.0.0.1",
        transfer_timeout_s: float = 3.0,
        timeout_s: float = 300.0,
        simulated: SimulatedLink | None = None,
    ):
        self.sessions = Sessions(host, transfer_timeout_s, join_timeout_s=timeout_s)
        self.sessions.simulated = simulated  # comm.simulate: the syncer's transfers slowed
        self.service = HostedService(
            self.sessions, workers, end_wait_s=transfer_timeout_s, modelled=False,
            min_quorum=min_quorum, grace_s=grace_s, collective_rounds=False,
            timeout_s=timeout_s, bootstrap=build_syncer,
        )  # fmt: skip

    @property
    def address(self) -> str:
        """host:port of its store: what a worker joins (`links.join_session`)."""
        return self.sessions.address

    def start(self) -> None:
        self.service.start()

    def lose(self, worker: int) -> None:
        """The launcher gave up on `worker`: no meeting waits for it."""
        self.service.lose(worker)

    def close(self, timeout_s: float) -> None:
        """Wait for the syncer to finish (every worker done or lost); raise its error."""
        self.service.join(timeout_s)


def build_syncer(request: dict, receive_one) -> tuple[Syncer, list[Decoders]]:
    """The syncer from the first worker's `request` (`rejoin.spec`) and its model, read by
    `receive_one(tensor)` buffer by buffer, then any state it resumes from; and the decoders
    of the run's wire."""
    spec = request["spec"]
    buffers = [torch.empty(n, dtype=getattr(torch, dtype)) for n, dtype in spec["buffers"]]
    for b in buffers:
        receive_one(b)
    sgd = dict(spec["sgd"])
    if sgd.get("delay") is not None:
        sgd["optimizer"] = DelayedNesterov
    aggregate = None if spec["aggregate"] is None else Aggregate(**spec["aggregate"])
    correction = None if spec["correction"] is None else HeLoCo(**spec["correction"])
    parts = [[tuple(s) for s in part] for part in spec["parts"]]
    syncer = Syncer(
        buffers, parts, sgd, spec["plain_first"], aggregate,
        correction, [tuple(b) for b in spec["blocks"]], spec["normalized"],
        spec.get("max_staleness"), FleetPeriod.build(spec.get("period")),
    )  # fmt: skip
    if spec.get("state") is not None:  # resumed: the checkpoint's syncer goes on
        syncer.load_state_dict(tree_from_json(spec["state"], receive_one))
    return syncer, part_decoders(buffers, parts, _wire(spec["wire"]))


def _wire(wire: dict):
    if "block" in wire:
        return comm_dtype_of(wire["block"], wire["block_size"])
    if "topk" in wire:
        return TopKCodec(wire["topk"], wire["chunk"], wire["mean"])
    return getattr(torch, wire["dtype"])


class HostedService(SyncerService):
    """`SyncerService` over `links.Sessions`: workers join (and join again after a failure or a
    restart), the start waits for every worker once, a failed transfer drops that worker's
    session instead of failing the run, and a meeting waits `end_wait_s` for a worker behind,
    then is held without it (see the module doc)."""

    def __init__(self, sessions: Sessions, size: int, *, end_wait_s: float, **kwargs):
        super().__init__(None, sessions, size, **kwargs)
        self.end_wait_s = end_wait_s
        # each worker's state as of its last contribution received (where its next process
        # resumes) and when that was
        self.resume: dict[int, tuple[dict, float] | None] = {}
        self.unconfirmed: dict[int, tuple[dict, float] | None] = {}
        self.joined = [0] * size  # sessions opened per worker: its first, then rejoins
        self.dropped_sessions = 0  # sessions that failed mid-transfer
        self.started = False  # every worker joined once
        self.held: set[int] = set()  # workers that joined before the start, not welcomed yet
        self.meeting_deadline: float | None = None  # once one worker is at a meeting
        self.meetings_held: set[int] = set()  # their steps: a worker later there meets alone
        self.stop_agreed = False  # a worker at a meeting asked to stop: the run ends there
        self.ended = False  # the last (or a stopping) meeting is over: one behind is told stop
        self.state_tensors: list[torch.Tensor] = []  # the syncer's state, for the writer

    def _read(self) -> bool:
        moved = False
        for request in self.links.joins():
            self._join(request)
            moved = True
        return super()._read() or moved

    def _advance(self) -> bool:
        if not self.started and self._all_in():  # checked on every turn: `lose` rings no bell
            self._start()
            return True
        return super()._advance()

    def _take_header(self, r: int, header: dict) -> None:
        if self.ended:
            self._stop(r, header)
        else:
            super()._take_header(r, header)
            if header.get("resume") is not None:  # where its next process starts, should it die
                if header["samples"] > 0:  # until its contribution is in: `_receive`
                    self.unconfirmed[r] = self.resume.get(r)
                self.resume[r] = (header["resume"], time.monotonic())

    def _receive(self, r: int, f: int) -> tuple[list[torch.Tensor], list | None]:
        received = super()._receive(r, f)
        self.unconfirmed.pop(r, None)  # its contribution arrived: it resumes after it
        return received

    def _reachable(self, r: int) -> bool:
        return self.links.connected(r)

    def _join(self, request: dict) -> None:
        """A worker's new session (its first, a restart's, or a reconnect): whatever its last
        session left half done is forgotten (a contribution received in full stays pending); it
        is welcomed with the global model and, after a restart, the state it resumes from."""
        r = request["worker"]
        self._forget(r)
        if self.ended:  # the run is over: a worker back now has nothing left to do
            try:
                self.links.accept(request)
                self.links.box(r).put("welcome", {"stop": True, "version": self.syncer.version})
            except LINK_ERRORS:
                self.links.drop(r)
            self.done[r] = True
            return
        try:
            self.links.accept(request)
        except LINK_ERRORS:  # it died while joining: its next process joins again
            self.links.drop(r)
            return
        box = self.links.box(r)
        self.seq[r], self.done[r] = 0, False
        self.lost.discard(r)
        self.joined[r] += 1
        if self.syncer is None:  # the first worker brings the global model every worker holds
            box.put("welcome", {"init": True})
            try:
                self.syncer, self.decoders = self.bootstrap(
                    request, lambda t: self.links.recv(r, t, TAG_VALUES)
                )
            except LINK_ERRORS:
                self.links.drop(r)
                return
        if self.started:
            self._welcome(r)
        else:  # nobody trains before every worker is here (or given up on): `_start`
            self.held.add(r)

    def _all_in(self) -> bool:
        """Every worker joined once, or the launcher gave up on it before it could."""
        return self.syncer is not None and all(
            self.joined[w] or w in self.lost for w in range(self.size)
        )

    def _start(self) -> None:
        """The global model to every worker held for the start (those still connected)."""
        self.started = True
        for w in sorted(self.held):
            if self.links.connected(w):
                self._welcome(w)
        self.held.clear()

    def _welcome(self, r: int) -> None:
        """The global model to a worker that joined, and where it resumes after a restart."""
        box = self.links.box(r)
        resume, since = self.resume.get(r) or (None, None)
        box.put(
            "welcome",
            {"versions": list(self.syncer.versions), "values": True, "resume": resume,
             "since_s": None if since is None else time.monotonic() - since, **self._period()},
        )  # fmt: skip
        self._send_values(r)

    def _forget(self, r: int) -> None:
        """Worker r's session is gone: nothing it sent is half read, nobody waits on it."""
        self.links.drop(r)
        self.inbox[r].clear()
        self.waiting.pop(r, None)
        self.met[r] = None
        self.announced[r] = None

    def _failed(self, r: int) -> None:
        """Its session failed mid-transfer: dropped (it rejoins), the run goes on."""
        self.dropped_sessions += 1
        if r in self.unconfirmed:  # its last contribution never arrived: resume before it
            self.resume[r] = self.unconfirmed.pop(r)
        self._forget(r)

    def lose(self, r: int) -> None:
        """The launcher gave up on worker r (out of restarts): nobody waits for it."""
        self.lost.add(r)

    def _meet_without(self, live: list[int]) -> bool:
        """Sessions: a meeting waits `end_wait_s` from the first worker there for the others;
        a worker still behind then (restarting, frozen, cut off) is not waited for. The meeting
        is held without it; it meets alone when it gets there (after the last meeting, or one
        that stopped the run, it is told to stop instead: what it has not trained is not
        merged, as a worker away mid-run)."""
        met = [r for r in live if self.met[r] is not None]
        if not met:
            return False
        late = [r for r in met if self.met[r]["step"] in self.meetings_held]
        if late:
            self._meet(late)
            return True
        if self.meeting_deadline is None:
            self.meeting_deadline = time.monotonic() + self.end_wait_s
        if time.monotonic() < self.meeting_deadline:
            return False
        self._meet(met)
        return True

    def _late(self, live: list[int]) -> bool:
        """Whether the workers meeting are at a meeting held already (its checkpoint written)."""
        return {self.met[r]["step"] for r in live} <= self.meetings_held

    def _meet(self, live: list[int]) -> None:
        steps, late = {self.met[r]["step"] for r in live}, self._late(live)
        last = any(self.met[r].get("last") for r in live)
        if not late:  # a stop is agreed where a checkpoint is written: the next one
            self.stop_agreed = self.stop_agreed or any(self.met[r].get("stop") for r in live)
        super()._meet(live)
        if not late:  # one behind, met alone, does not reset the others' meeting
            self.meetings_held |= steps
            self.meeting_deadline = None
        self.ended = self.ended or last or self.stop_agreed

    def _stop(self, r: int, header: dict) -> None:
        """After the last meeting (or one that stopped the run): worker r is told to stop
        (nothing it sends is merged)."""
        if header["kind"] in (SEND, MEET):
            self.links.box(r).put(f"d/{r}/{header['seq']}", {"do": "stop"})
        if header["kind"] != ANNOUNCE:
            self.done[r] = True

    def _last_words(self, live: list[int]) -> dict:
        """A meeting's answers: who writes the checkpoint and the results (the first worker
        there; nobody at a meeting held late), the syncer's state's layout (its tensors follow
        the global model to the writer), whether the run stops here, the syncer's record,
        which only this process holds, and the global model's checksum, which every worker
        there must now hold bit for bit (`sync.check_replicas` checks it there)."""
        writer = None if self._late(live) else min(live)
        packed, self.state_tensors = (
            tree_as_json(self.syncer.state_dict()) if writer is not None else (None, [])
        )
        return {
            "writer": writer, "state": packed, "stop": self.stop_agreed,
            "syncer": self.record(), "checksum": replica_checksum(self.syncer.values).tolist(),
        }  # fmt: skip

    def _answer(self, r, header, at, values=False, extra=None) -> None:
        super()._answer(r, header, at, values, extra)
        if extra and extra["writer"] == r and self.links.connected(r):
            try:  # the syncer's state after the global model, to the one that checkpoints
                for t in self.state_tensors:
                    self.links.send(r, t, TAG_VALUES)
            except LINK_ERRORS:
                self._failed(r)

    def record(self) -> dict:
        return {
            **super().record(),
            "async_sessions": list(self.joined),  # per worker: its first and its rejoins
            "async_failed_sessions": self.dropped_sessions,
            "merged_samples": self.syncer.merged_samples,
        }

"""The syncer's thread on rank 0 (`SyncerService`): it reads the workers' messages, orders
them, merges, and answers each sender with the newest global model.

**Order.** Under the modelled clock (`comm.simulate.worker_speed`/`step_s`) every message
carries its modelled send time and the sender's next one (announced in advance: a worker's
steps take a known time). The syncer handles the earliest time first, once no worker can still
send anything earlier: the order is fixed by the model, never by the machine's load, and a run
equals a one-process replay of that order. Messages of one time are handled together, in rank
order. On the wall clock they are handled as they arrive.

**A time's messages.** A worker *sends* (its inner phase ended) or *meets* (a checkpoint step
or the end: every worker waits there for the others, and a meeting merges whatever is pending).
Each sender is told to send its contribution (point-to-point), or, where every worker sends at
one time, nothing is pending and none is stale, to join a synchronous round instead: the
all-reduced mean, then this thread's outer step, then a broadcast (the synchronous rounds'
bits). A merge runs once `min_quorum` workers have contributions pending, and either every
worker due within the grace window of its oldest one has sent or the window has passed
(modelled seconds, or the wall clock's); a sender is answered right away with the global model
as of its time, so nobody waits for a quorum. A meeting answers once every worker is there.
The window is `grace_s`, or, where that is None, *adaptive*: one step of the slowest worker,
from the step lengths the workers report (modelled, or measured), so that contributions one
step apart make one merge. A worker is due where its next message (announced in advance under
the modelled clock; its last interval on the wall clock, `pacing`) falls within the window: a
merge never waits for one that cannot arrive in it.

**Fragments** (Streaming DiLoCo): a header names the fragments it carries (`fragments`: one
when a phase ends, every one at a meeting), their weights (the samples each was trained on
since its last sync) and the sender's version of each; the answer carries the global values of
those fragments only, where they changed since the sender's versions.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from typing import Any

import torch

from localsgd.averaging.asynchronous.in_flight import idles
from localsgd.averaging.asynchronous.links import (
    LINK_ERRORS,
    TAG_PAYLOAD,
    TAG_VALUES,
    Sessions,
    WorldLinks,
)
from localsgd.averaging.asynchronous.messages import ANNOUNCE, DONE, MEET, SEND, Decoders
from localsgd.averaging.asynchronous.pacing import Pacing
from localsgd.averaging.asynchronous.syncer import Arrival, Syncer
from localsgd.averaging.asynchronous.synchronous_rounds import Gathering, SynchronousRounds
from localsgd.averaging.virtual import wait_outside


class SyncerService(SynchronousRounds):
    """The syncer's loop: a thread beside rank 0's training (`links`: `WorldLinks`), or in a
    process that trains nothing (`Sessions`: workers join, die and join again; `hosted`). `size`
    workers; `modelled`: messages carry modelled times; `syncer`: None until the first worker
    to join brings the global model (`bootstrap(request, receive)` builds it)."""

    def __init__(
        self,
        syncer: Syncer | None,
        links: WorldLinks | Sessions,
        size: int,
        *,
        modelled: bool,
        min_quorum: int,
        grace_s: float | None,
        collective_rounds: bool = True,
        decoders: list[Decoders] | None = None,
        timeout_s: float = 300.0,
        bootstrap=None,
        hold_senders: bool = True,
    ):
        self.syncer, self.links, self.size = syncer, links, size
        self.timeout_s, self.bootstrap = timeout_s, bootstrap
        # the worker training beside this thread (its messages go in-process), if any
        self.local = None if links.sessions else 0
        self.modelled, self.min_quorum, self.grace_s = modelled, min_quorum, grace_s
        self.collective_rounds = collective_rounds
        # a sender waits (at most the window) for the merge that takes its contribution; not
        # where workers meet in groups (inner levels): its group's next mean needs it
        self.hold_senders = hold_senders
        self.decoders = decoders  # each part's messages to fp32 (None: fp32 as sent)
        self.lock = threading.Lock()
        self.payload: queue.Queue = queue.Queue()  # rank 0's own contributions
        self.values: queue.Queue = queue.Queue()  # ... and the global model sent to it
        self.collective_done = threading.Event()
        self.error: BaseException | None = None
        self.seq = [0] * size
        self.inbox: list[deque] = [deque() for _ in range(size)]
        self.announced: list[float | None] = [None] * size
        self.met: list[dict | None] = [None] * size
        self.done = [False] * size
        self.lost: set[int] = set()  # workers nobody waits for any more (`hosted`)
        self.step_seconds: dict[int, float] = {}  # each worker's step length, as it reports
        self.pacing = Pacing(self.grace, modelled)  # the wall clock's: who a merge waits for
        self.gathering = Gathering(size, self.grace)  # the wall clock's synchronous rounds
        self.deadline: float | None = None  # the next merge's, once the quorum is there
        self.passed = -math.inf  # the modelled time handled last (one world: a check)
        # senders waiting (at most grace_s) for the merge that takes their contribution:
        # worker -> (its header, when it is answered anyway)
        self.waiting: dict[int, tuple[dict, float]] = {}
        self.events: list[dict[str, Any]] = []  # what was merged, when (the run's record)
        self.sent_bytes = 0  # the global model sent to the other workers (fp32)
        self.start_time = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="localsgd-syncer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> None:
        """Raise the syncer thread's error (called by rank 0's training while it waits)."""
        if self.error is not None:
            raise RuntimeError(f"asynchronous rounds: the syncer failed: {self.error}")

    def join(self, timeout_s: float) -> None:
        # virtual workers: the others run meanwhile (their last messages end the syncer)
        wait_outside(lambda: not self.thread.is_alive())
        self.thread.join(timeout_s)
        self.alive()
        if self.thread.is_alive():
            raise TimeoutError("asynchronous rounds: the syncer did not finish (dist.timeout_s)")

    # --- the loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            idle_since, heard, pause = time.monotonic(), -1, 1e-4
            while not all(self.done[r] or r in self.lost for r in range(self.size)):
                rung = self.links.rung()
                moved = rung != heard and self._read()
                heard = rung
                while self._advance():
                    moved = True
                if moved:
                    idle_since, pause = time.monotonic(), 1e-4
                else:
                    if time.monotonic() - idle_since > self.timeout_s:
                        raise TimeoutError(
                            f"no worker message for {self.timeout_s:g} s (dist.timeout_s)"
                        )
                    # idle: back off to 2 ms between looks, one store call each (the bell)
                    time.sleep(pause)
                    pause = min(2 * pause, 2e-3)
        except BaseException as e:  # raised in rank 0's training thread by `alive`
            self.error = e

    def _read(self) -> bool:
        moved = False
        for r in range(self.size):
            if not self._reachable(r):
                continue
            box = self.links.box(r)
            while not self.done[r] and box.has(f"h/{r}/{self.seq[r]}"):
                header = box.take(f"h/{r}/{self.seq[r]}")
                header["seq"] = self.seq[r]
                header["arrived"] = self._now()
                self.seq[r] += 1
                moved = True
                self._take_header(r, header)
        return moved

    def grace(self) -> float:
        """The grace window: `grace_s`, or one step of the slowest worker (adaptive)."""
        if self.grace_s is not None:
            return self.grace_s
        return max(self.step_seconds.values(), default=0.0)

    def _due(self, r: int, oldest: float) -> bool:
        """Whether a merge whose oldest contribution came at `oldest` waits for worker r: its
        next message falls within the window (under the modelled clock, announced; on the wall
        clock, `pacing.due`)."""
        if not self.modelled:
            return self.pacing.due(r, oldest)
        upcoming = self.inbox[r][0]["time"] if self.inbox[r] else self.announced[r]
        return upcoming is not None and upcoming <= oldest + self.grace()

    def _take_header(self, r: int, header: dict) -> None:
        if header.get("step_s"):
            self.step_seconds[r] = header["step_s"]
        # the order is the model's only if no message comes from before a time handled
        late = self.modelled and self.local is not None and header.get("time") is not None
        if late and header["time"] < self.passed:
            raise RuntimeError(
                f"asynchronous rounds: worker {r}'s message of modelled time "
                f"{header['time']:g} s came after the syncer had handled {self.passed:g} s "
                "(a worker's next time was announced wrong)"
            )
        if header["kind"] == ANNOUNCE:
            self.announced[r] = header["next"]
        elif header["kind"] == DONE:
            self.done[r] = True
        else:
            self.inbox[r].append(header)

    # --- what a hosted syncer does otherwise (`hosted.HostedService`) ---------------------------

    def _reachable(self, r: int) -> bool:
        """Whether worker r can be heard from now (in one world: always)."""
        return True

    def _failed(self, r: int) -> None:
        """A transfer with worker r failed: in one world the run fails with it."""
        raise

    def _meet_without(self, live: list[int]) -> bool:
        """Whether a meeting was held without a worker still behind (never, in one world)."""
        return False

    def _last_words(self, live: list[int]) -> dict:
        """What a meeting's answers carry besides the model (nothing, in one world)."""
        return {}

    def _live(self, w: int) -> bool:
        """Whether worker w is still in the run and can be heard from."""
        return not self.done[w] and w not in self.lost and self._reachable(w)

    def _now(self) -> float:
        return time.monotonic() - self.start_time

    def _advance(self) -> bool:
        """Handle the next time's messages, a merge or a wait whose time came, or a meeting
        every worker reached; whether anything happened."""
        live = [r for r in range(self.size) if not self.done[r] and r not in self.lost]
        if live and all(self.met[r] is not None for r in live):
            self._meet(live)
            return True
        if self._meet_without(live):
            return True
        times: dict[int, float] = {}
        for r in live:
            if self.met[r] is not None or r in self.waiting:
                continue  # it sends nothing before it is answered
            if self.inbox[r]:
                times[r] = self.inbox[r][0]["time" if self.modelled else "arrived"]
            elif not self.modelled:
                continue
            elif self.announced[r] is None:
                return False  # its next time is not known yet
            else:
                times[r] = self.announced[r]
        now = min(times.values()) if times else math.inf
        if not self.modelled:
            now = min(now, self._now())
        deadline = math.inf if self.deadline is None else self.deadline
        due = min([deadline, *(until for _, until in self.waiting.values())])
        if due < now or (not self.modelled and due <= now):
            self._timed(due)
            return True
        if self.gathering.expired(self._now()):  # no synchronous round: point-to-point
            self._release()
            return True
        group = sorted(r for r, t in times.items() if t == now and self.inbox[r])
        if not group or (
            self.modelled and any(not self.inbox[r] for r in times if times[r] == now)
        ):
            return False
        if not self.modelled:
            group = group[:1]
        headers = {r: self.inbox[r].popleft() for r in group}
        if not self.modelled and self._gathered(headers):
            return True
        self._handle(now, headers)
        return True

    def _timed(self, at: float) -> None:
        """A merge whose grace ran out, then the senders whose wait did."""
        self.passed = max(self.passed, at)
        if self.deadline is not None and self.deadline <= at:
            self._merge(at)
        for r, (header, until) in list(self.waiting.items()):
            if until <= at:
                del self.waiting[r]
                self._answer(r, header, at)

    def _handle(self, now: float, headers: dict[int, dict]) -> None:
        syncer = self.syncer
        self.passed = max(self.passed, now)
        for r, h in headers.items():
            self.announced[r] = h["next"] if h["kind"] == SEND else None
        if self.modelled and self._round_fits(headers):
            self._collective(now, headers)
            return
        for r in sorted(headers):
            h = headers[r]
            box = self.links.box(r)
            if h["samples"] > 0:
                box.put(f"d/{r}/{h['seq']}", {"do": "payload"})
                try:
                    received = [self._receive(r, f) for f in h["fragments"]]
                except LINK_ERRORS:  # it died or was cut off mid-transfer: nothing arrived
                    self._failed(r)
                    del headers[r]
                    continue
                for i, (f, weight, (t, sent)) in enumerate(
                    zip(h["fragments"], h["weights"], received, strict=True)
                ):  # its loss (an adaptive period's) rides with its first fragment
                    loss = h.get("loss") if i == 0 else None
                    syncer.add(Arrival(r, now, weight, h["versions"][f], t, f, loss, sent,
                                       phase=h["kind"] == SEND))  # fmt: skip
                self.pacing.arrived(r, now)
            else:
                box.put(f"d/{r}/{h['seq']}", {"do": "wait"})
        merged = False
        if syncer.workers_pending() >= self.min_quorum:
            # a worker away (dead, restarting, cut off) is not waited for by the grace window
            live = {r for r in range(self.size) if self._live(r)}
            oldest = min(a.time for a in syncer.pending)
            awaited = {r for r in live if self._due(r, oldest)}
            everyone = {a.worker for a in syncer.pending} >= awaited
            if everyone or oldest + self.grace() <= now:
                self._merge(now)
                merged = True
            elif self.deadline is None:
                self.deadline = oldest + self.grace()
        for r, h in headers.items():
            if h["kind"] == MEET:
                self.met[r] = {**h, "at": now}
            elif self.hold_senders and self.grace() > 0 and h["samples"] > 0 and not merged:
                self.waiting[r] = (h, now + self.grace())  # for its merge, at most the window
            else:
                self._answer(r, h, now)

    def _merge(self, at: float) -> None:
        """Merge what is pending; every sender waiting for it is answered after it."""
        pending = self.syncer.pending
        count, versions = len(pending), self.syncer.versions
        staleness = [versions[a.fragment] - a.version for a in pending]
        with self.lock:
            merged = self.syncer.merge()
        self.deadline = None
        if merged:
            self._record(at, count, staleness, "merge")
        for r, (header, _) in list(self.waiting.items()):
            del self.waiting[r]
            self._answer(r, header, at)

    def _meet(self, live: list[int]) -> None:
        at = max(self.met[r]["at"] for r in live)
        if self.syncer.pending:
            self._merge(at)
        self.deadline = None
        extra = self._last_words(live)  # a hosted syncer's: who writes, its record, ...
        for r in live:
            self._answer(r, self.met[r], at, values=True, extra=extra)
            self.met[r] = None
            self.announced[r] = None

    def record(self) -> dict[str, Any]:
        """What the syncer did (a summary's `async_*` entries)."""
        syncer = self.syncer
        out = {
            "async_merges": syncer.version,
            "async_max_staleness": max(syncer.staleness, default=0),
            "async_dropped_nonfinite": [list(d) for d in syncer.dropped],
            "async_dropped_stale": [list(d) for d in syncer.too_stale],
            "async_syncer_bytes": self.sent_bytes,
            "async_merged_samples": syncer.merged_samples,
            "async_mean_staleness": (
                sum(syncer.staleness) / len(syncer.staleness) if syncer.staleness else 0.0
            ),
        }
        if syncer.correction is not None:  # blocks kept, shrunk, reoriented
            out["async_corrected_blocks"] = dict(syncer.correction.counts)
        if syncer.period is not None:  # the adaptive period: where it ended, how often decided
            out["async_period"] = syncer.period.period
            out["async_period_decisions"] = syncer.period.decisions
        return out

    def _answer(
        self, r: int, header: dict, at: float, values: bool = False, extra: dict | None = None
    ) -> None:
        versions = self.syncer.versions
        values = values or any(header["versions"][f] != versions[f] for f in header["fragments"])
        sends = self.modelled and header["kind"] == SEND
        if sends and (idles(header, at) or self._moved(header)):  # it waited, or its
            self.announced[r] = None  # period moved: it announces its next time again
        if not self._reachable(r):
            return  # its session failed meanwhile: it is welcomed afresh when it rejoins
        align = self.pacing.align(r, at, self._live) if header["kind"] == SEND else None
        self.links.box(r).put(
            f"r/{r}/{header['seq']}",
            {"version": self.syncer.version, "versions": list(versions), "time": at,
             "values": values, "align_s": align, **self._period(), **(extra or {})},
        )  # fmt: skip
        if values:
            self._send_values(r, header["fragments"])

    def _moved(self, header: dict) -> bool:
        """Whether an adaptive period's decision moved the period `header`'s sender trained at
        (its next send time, announced at the old one, then moves)."""
        period = self.syncer.period
        return period is not None and header.get("period") != period.period

    def _period(self) -> dict:
        """What an answer carries of an adaptive period: the syncer's decision as it stands."""
        period = self.syncer.period
        return {} if period is None else {"period": period.period}

    def _send_values(self, r: int, fragments: list[int] | None = None) -> None:
        """The global values of `fragments` (None: the whole model) to worker r, in-process to
        the worker beside this thread."""
        with self.lock:
            if fragments is None:
                values = self.syncer.values_of(None)
            else:
                values = [v for f in fragments for v in self.syncer.values_of(f)]
            if r == self.local:
                self.values.put([v.clone() for v in values])
                return
            # host copies: the point-to-point group is gloo's, on every device
            hosted = [v.detach().cpu().contiguous() for v in values]
        try:
            for v in hosted:
                self.links.send(r, v, TAG_VALUES)
                self.sent_bytes += v.numel() * v.element_size()
        except LINK_ERRORS:
            self._failed(r)

    def _receive(self, r: int, f: int) -> tuple[list[torch.Tensor], list | None]:
        """Worker r's contribution to fragment f (the whole model, unfragmented), and with a
        senders' mean where each top-k piece's message held an index (`messages.sent_marks`)."""
        if r == self.local:
            return self.payload.get(timeout=self.timeout_s)
        decoders = None if self.decoders is None else self.decoders[f]
        if decoders is None:
            messages = [torch.empty_like(v, device="cpu") for v in self.syncer.values_of(f)]
        else:
            messages = decoders.empty()
        for m in messages:
            self.links.recv(r, m, TAG_PAYLOAD)
        sent = [] if decoders is not None and decoders.senders else None
        tensors = messages if decoders is None else decoders.decode(messages, sent)
        device = self.syncer.values[0].device
        if sent is not None:
            sent = [None if m is None else m.to(device) for m in sent]
        return [t.to(device) for t in tensors], sent

    def _record(self, at: float, count: int, staleness: list[int], how: str) -> None:
        self.events.append(
            {"time": round(at, 9), "version": self.syncer.version, "contributions": count,
             "max_staleness": max(staleness, default=0), "how": how}
        )  # fmt: skip

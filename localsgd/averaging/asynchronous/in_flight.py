"""Exchanges in flight (`sync.delay_steps` = τ > 0 with asynchronous rounds; `sync.overlap=true`
is τ = 1 with the progress merge): a worker sends its phase's contribution and trains on from
its own model while the exchange runs, then takes the answer as the synchronous delayed rounds
do (`merge.merge_`): keeping what it trained meanwhile, `local <- global + (local - local at
the send)` (`sync.merge_rule=progress`), or mixing, `local <- alpha local + (1 - alpha) global`
(`sync.merge_alpha`; 0: the global model replaces it).

- **When the answer lands.** Under the modelled clock, at the end of the worker's τ-th computed
  step after the send: the exchange itself runs at the send, in the training thread (the
  syncer's order is the modelled one, so nothing is gained by a thread, and the run stays
  deterministic). On the wall clock the exchange runs in a thread of its own and the answer
  lands at the end of the first step, τ or more after the send, by which it has arrived: a slow
  link, or a syncer cut off (a partition), costs the worker no training time.
- **A phase that ends while its last exchange is still in flight** (the wall clock) does not
  send: it trains on, and sends its samples, all of them, as soon as that answer has landed.
  On the wall clock the first exchange of a process is waited for (it lands a step later all
  the same): the syncer may still be starting, and no worker trains a long first phase alone.
- **A sender in flight is held for its merge** (at most the grace window) as any sender, but
  it trains on meanwhile; it never joins a synchronous round (its header says `in_flight`),
  whose all-reduce would need it in the training thread. Under the modelled clock the answer
  lands at the first computed step at or after the merge's time; a merge later than the
  worker's next send makes it idle until then instead, as without a flight.
- Meetings and the end are exchanges as without it: the answer in flight lands first.
- A session that failed in flight (a hosted syncer) rejoins when it lands: the global model
  replaces the worker's, as a failed exchange does without it (`rejoin`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from localsgd.averaging.asynchronous.clock import instant
from localsgd.averaging.asynchronous.links import LINK_ERRORS
from localsgd.averaging.asynchronous.messages import ANNOUNCE, SEND
from localsgd.averaging.asynchronous.rejoin import rejoin
from localsgd.averaging.binding import mirrored
from localsgd.averaging.rounds.merge import merge_
from localsgd.averaging.rounds.part import new_like, views


def idles(header: dict, at: float) -> bool:
    """Whether the sender of `header` (modelled clock), answered at time `at`, idles until then
    (it then announces its next time again): a sender in flight trains on unless its merge
    comes after its next send."""
    if header.get("in_flight"):
        return header["next"] is not None and at >= header["next"]
    return at > header["time"]


@dataclass
class Flight:
    """One exchange in flight: its header, the contribution (then the global values the answer
    brings), the worker's values at the send, and what came back."""

    step: int
    seq: int
    header: dict
    fragment: int
    work: list[torch.Tensor]
    origins: list[torch.Tensor] | None
    link: object
    decision: dict | None = None
    answer: dict | None = None
    answered_at: float = 0.0  # perf_counter when the answer arrived
    lands_at: float = 0.0  # the modelled clock: the merge's time
    after: int = 0  # the steps computed since the send
    error: BaseException | None = None
    wait_s: float = 0.0
    sent_bytes: int = 0
    sent_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class InFlightExchanges:
    """The in-flight half of `AsyncAverager` (a mixin: it reads the averager's rounds, buffers,
    link, service and phase counters)."""

    delay = 0  # τ: an answer lands τ steps after its send, or later (0: exchanges block)
    merge_rule, merge_alpha = "mix", 0.0  # how it lands (`merge.merge_`)
    flight: Flight | None = None
    deferred = False  # a phase ended while the last exchange was still in flight
    heard = False  # this process exchanged with the syncer (its first exchange is waited for)

    def _lands(self, computed: bool) -> bool:
        """Whether the answer in flight lands at the end of this tick."""
        flight = self.flight
        if flight is None:
            return False
        flight.after += computed
        if flight.after < self.delay:
            return False
        if not self.modelled:
            return flight.done.is_set()
        return computed and instant(self.clock) >= flight.lands_at

    @mirrored()  # sharded parameters: their values in the flat buffers while it runs
    def _launch(self, step: int) -> None:
        """Send this phase's contribution (its fragment) and train on (see the module doc)."""
        rounds, buffers = self.rounds, self.flat.buffers
        samples, f = self.phase_samples, self.turn
        part = rounds.parts[f]
        unsynced = [n + samples for n in self.unsynced]
        keeps = self.merge_rule == "progress"  # where the worker's values were at the send
        origins = [t.detach().clone() for t in views(buffers, part)] if keeps else None
        work = new_like(buffers, part)
        rounds.offer(f, buffers, work)
        seq, header = self._header(
            SEND, time=instant(self.clock) if self.modelled else None, samples=samples,
            fragments=[f], weights=[unsynced[f]], versions=list(self.versions),
            next=self._next_time(step) if self.modelled else None,
            resume=self.resume_state() if self.resume_state is not None else None,
            last=False, step=step, stop=False, in_flight=True, **self._loss_report(False),
        )  # fmt: skip
        self.unsynced = [0.0 if i == f else n for i, n in enumerate(unsynced)]
        self.phase_samples, self.phase_time, self.phase_steps = 0.0, 0.0, 0
        self.turn = (self.turn + 1) % self.fragments
        flight = Flight(step, seq, header, f, work, origins, self.link)
        self.flight = flight
        if not self.modelled:
            threading.Thread(
                target=self._transfer, args=(flight,), name="localsgd-async-send", daemon=True
            ).start()
            if not self.heard:  # the syncer may still be starting: no phase runs past it
                self._wait_for(flight)
            return
        self._transfer(flight)
        if flight.error is not None:
            return
        moved = self._take_answer(flight)
        if flight.answer is not None:
            flight.lands_at = flight.answer["time"]
            if header["next"] is not None and flight.lands_at >= header["next"]:
                # merged after this worker's next send would be: it idles until then
                self.clock = flight.lands_at
                moved = True
        if moved:  # its next send comes at another time than it said
            self._send_header(ANNOUNCE, next=self._next_time(step))

    def _transfer(self, flight: Flight) -> None:
        """The exchange's messages: the header, the syncer's decision, the payload, the answer
        and the global values into `flight.work` (in a thread of its own on the wall clock:
        only `flight` is written)."""
        try:
            self._messages(flight)
        except BaseException as e:  # raised, or rejoined, where the answer lands
            flight.error = e
        finally:
            flight.answered_at = time.perf_counter()
            flight.done.set()

    def _messages(self, flight: Flight) -> None:
        link, rank, seq = flight.link, self.rank, flight.seq
        link.mailbox.put(f"h/{rank}/{seq}", flight.header, ring=True)
        flight.decision = self._take(f"d/{rank}/{seq}", flight)
        if flight.decision["do"] == "stop":
            return
        if flight.decision["do"] == "payload":
            flight.sent_bytes, flight.sent_s = self._send_payload(flight.work, flight.fragment)
        flight.answer = self._take(f"r/{rank}/{seq}", flight)
        if flight.answer["values"]:
            self._receive_values(flight.work)

    def _take_answer(self, flight: Flight) -> bool:
        """The answer's word apart from its values: the run's stop, the adaptive period;
        whether the period moved."""
        if flight.decision["do"] == "stop":
            self.stopped = True
            return False
        moved = self._take_period(flight.decision)
        return self._take_period(flight.answer) or moved

    def _drain(self) -> None:
        """The answer in flight lands now (before a meeting or the end), waited for."""
        if self.flight is None:
            return
        self._wait_for(self.flight)
        self._land()

    def _wait_for(self, flight: Flight) -> None:
        if not flight.done.wait(self.timeout_s):
            raise TimeoutError(
                f"asynchronous rounds: no answer from the syncer within {self.timeout_s:g} s "
                "(dist.timeout_s)"
            )

    @mirrored()
    def _land(self) -> None:
        """The answer in flight lands: the global values, plus what this worker trained since
        it sent."""
        flight, self.flight = self.flight, None
        self.heard = True
        self.wait_s += flight.wait_s
        before = self.stats.bytes
        self.stats.bytes += flight.sent_bytes
        self.stats.seconds += flight.sent_s
        self._count(len(self.levels) - 1, before)
        self.merged = self.all_in_sync = False
        if flight.error is not None:
            if not isinstance(flight.error, LINK_ERRORS) or self.syncer_address is None:
                raise flight.error
            rejoin(self)  # the global model replaces this worker's, as without a flight
            return
        if not self.modelled:
            self._take_answer(flight)
        if self.stopped:
            return
        rounds, buffers, f = self.rounds, self.flat.buffers, flight.fragment
        part, answer = rounds.parts[f], flight.answer
        if not answer["values"]:  # the global values are still this worker's anchor
            for t, a in zip(flight.work, views(rounds.anchors.first, part), strict=True):
                t.copy_(a)
            self.exchanges["unchanged"] += 1
        else:
            self.exchanges["p2p"] += 1
        origins = flight.origins if self.merge_rule == "progress" else None
        merge_(views(buffers, part), flight.work, self.merge_alpha, origins)
        rounds.anchors.settle_(part, 0, flight.work)
        self.versions[f] = answer["versions"][f]
        if answer.get("align_s") is not None:  # out of step with the others: rejoin them
            self.align_until = flight.answered_at + answer["align_s"]
        self._run_hooks(self.comm, len(self.levels) - 1, f if self.fragments > 1 else None)

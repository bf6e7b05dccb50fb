"""`AsyncAverager`: DiLoCo's rounds without the barrier (`sync.mode=async`).

Each worker trains its inner phase (`period` steps, or, with `inner_time_s`, as many steps as
fit in that many seconds: Async Local-SGD's DyLU), sends its pseudo-gradient `anchor - local`
with the samples it trained on to the syncer, takes the newest global model back and trains on
from it without waiting for anyone (`service`, `syncer`). The syncer is a thread on rank 0
beside its training; what it holds (the global model, the outer optimizer) is checkpointed in
rank 0's averager state. Workers *meet* (every worker waits for the others and every pending
contribution is merged) at each `meet_every` step (the trainer's checkpoint steps, where every
worker then holds the same model to save) and at the last step, which leaves every worker with
the final global model. A worker that was away catches up at its next exchange: the answer
carries the global model whenever it changed since its own base. With `syncer_address` the
syncer is hosted by a process that trains nothing (`hosted`, `ft=torchft`): each worker is a
world of its own and reaches it through sessions (`links`, `rejoin`); a meeting's answer
then also names the worker that checkpoints (and brings it the syncer's state) and whether the
run stops there.

**Fragments** (`fragments` = P > 1, Streaming DiLoCo's split, `streaming.fragments`): a phase
is `period / P` steps (or `inner_time_s / P` seconds), and each phase sends the next fragment
in turn, its pseudo-gradient against its own anchor, weighed by the samples trained since that
fragment's last sync; the answer brings that fragment's global values back, and the other
fragments train on. So each fragment is synced every `period` steps, staggered by `period / P`
as in synchronous Streaming DiLoCo, and a message carries a fragment, not the model. A meeting
sends and takes back every fragment. The syncer keeps each fragment's outer step and version
(`syncer`).

**Inner levels** (`inner_levels={period: group_size}`, `sync.levels` but the widest): plain
means of the whole model within groups of workers at the steps their periods divide, every
worker of a group taking part at the same step; the widest level is the asynchronous one
(`_add_inner_levels`). A sender is then answered at once, not held for its merge (`service`).

**Sharded replica groups** (`process_group`: the ranks holding this rank's shard, one per
group): each shard has its own syncer, on the group's first rank, its own mailbox keys and
point-to-point group (`_point_to_point`); every rank sends its shard and takes its shard back.

Under the modelled clock (`step_s`, `speed`: `clock`) the order of
the syncer's merges is fixed: with every worker equally fast, a quorum of all of them and the
synchronous outer step, every round is a synchronous one and the run is today's synchronous
DiLoCo, bit for bit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from localsgd.averaging.asynchronous.clock import FITS, computes
from localsgd.averaging.asynchronous.clock import instant as _instant
from localsgd.averaging.asynchronous.delayed_nesterov import DelayedNesterov
from localsgd.averaging.asynchronous.fleet_period import FleetPeriod
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.asynchronous.in_flight import InFlightExchanges
from localsgd.averaging.asynchronous.links import (
    LINK_ERRORS,
    TAG_PAYLOAD,
    TAG_VALUES,
    WorkerLink,
    WorldLinks,
    world_link,
)
from localsgd.averaging.asynchronous.mailbox import Mailbox
from localsgd.averaging.asynchronous.messages import counts_senders, encode_, part_decoders
from localsgd.averaging.asynchronous.pacing import typical_step
from localsgd.averaging.asynchronous.phases import PhaseGrid
from localsgd.averaging.asynchronous.rejoin import join, rejoin
from localsgd.averaging.asynchronous.service import (
    ANNOUNCE,
    DONE,
    MEET,
    SEND,
    SyncerService,
)
from localsgd.averaging.asynchronous.syncer import Syncer
from localsgd.averaging.binding import mirrored
from localsgd.averaging.comm import VIRTUAL_BACKEND, CommStats, parallel_groups
from localsgd.averaging.hierarchical import inner_level_groups, level_by_period
from localsgd.averaging.outer import OuterAverager
from localsgd.averaging.rounds.part import views
from localsgd.averaging.streaming.fragments import FragmentOrder
from localsgd.averaging.trees import tree_from_json
from localsgd.averaging.trust.robust import Aggregate


class AsyncAverager(InFlightExchanges, FragmentOrder, OuterAverager):
    """`OuterAverager`'s rounds, asynchronous (see the module doc). `store`: the rendezvous
    store (messages); `run_id` keys them; `min_quorum`, `grace_s`: when the syncer merges
    (`grace_s` None: one step of the slowest worker, `service`);
    `outer_delay`: Delayed Nesterov's N (None: the synchronous outer step, torch's SGD);
    `inner_time_s`: the phase by time, not by `period` steps; `step_s` and `speed`: the
    modelled clock (`clock`: a step lasts speed x step_s, and a slower worker computes fewer
    of the ticks; None: the wall clock, every tick computes); `meet_every` (0: only at the
    end) and `max_steps`: the meetings; `timeout_s`: every wait's limit; `aggregate`: a robust
    rule for the syncer's merges; `correction`: HeLoCo's, applied by the syncer to each
    contribution (`heloco`); `normalized_merges`: a merge scales each change to its most
    samples before the weighted mean (`syncer`; not `Averager.normalized`, the time budget's
    rounds'); `max_staleness`: a contribution more merges old than that is not merged (None:
    every one is); `fragments`, `blocks`: Streaming DiLoCo's split (see the module doc; the
    blocks as `StreamingAverager`'s). The other keywords are
    `OuterAverager`'s. Call `computes()` before each step (whether to train it) and
    `maybe_average()` after every tick."""

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        module: torch.nn.Module,
        store: dist.Store,
        run_id: str,
        max_steps: int,
        min_quorum: int = 1,
        grace_s: float | None = 0.0,
        outer_delay: int | None = None,
        inner_time_s: float | None = None,
        step_s: float | None = None,
        speed: float = 1.0,
        meet_every: int = 0,
        timeout_s: float = 300.0,
        aggregate: Aggregate | None = None,
        correction: HeLoCo | None = None,
        normalized_merges: bool = False,
        max_staleness: int | None = None,
        syncer_address: str | None = None,
        worker: int = 0,
        workers: int | None = None,
        fragments: int = 1,
        blocks: Sequence[torch.nn.Module] | None = None,
        inner_levels: dict[int, int] | None = None,
        delay_steps: int = 0,
        merge_rule: str = "mix",
        merge_alpha: float = 0.0,
        **outer,
    ):
        if fragments < 1 or period % fragments:
            raise ValueError(
                f"sync.fragments must be >= 1 and divide sync.period={period}, got {fragments}"
            )
        self.fragments = fragments
        self._order_fragments(module, fragments, blocks)
        split = self.fragment_parts if fragments > 1 else None
        # the workers' own rounds are the mean's (a synchronous round's all-reduce); a robust
        # rule is the syncer's, over the contributions it holds one by one
        super().__init__(period, warmup_steps, process_group, module=module, split=split, **outer)
        self._add_inner_levels(inner_levels or {})
        self.aggregate, self.correction = aggregate, correction
        self.normalized_merges = normalized_merges
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"sync.max_staleness must be >= 0 or None, got {max_staleness}")
        self.max_staleness = max_staleness
        # a hosted syncer (`hosted`, ft=torchft): this worker is `worker` of `workers`, each in
        # a world of its own, and reaches the syncer through sessions (`links`)
        self.syncer_address = syncer_address
        if syncer_address is not None:
            size, rank = workers, worker
        else:
            size, rank = self.world_size, dist.get_rank(process_group)
        if not 1 <= min_quorum <= size:
            raise ValueError(
                f"sync.min_quorum must be in [1, {size}] (the workers), got {min_quorum}"
            )
        if grace_s is not None and grace_s < 0:
            raise ValueError(f"sync.grace_s must be >= 0 or None (adaptive), got {grace_s}")
        self.rank, self.workers, self.max_steps = rank, size, max_steps
        self.meet_every = meet_every
        self.inner_time_s, self.speed = inner_time_s, speed
        self.modelled = step_s is not None
        self.step_s = step_s
        self.step_seconds = speed * step_s if step_s is not None else None
        self.timeout_s = timeout_s
        self.link: WorkerLink | None = None
        # sharded replica groups: this rank averages its shard among the ranks that hold it
        self.sharded = process_group is not None and self.world_size < dist.get_world_size()
        if syncer_address is None:
            p2p, key = _point_to_point(process_group, timeout_s)
            self.link = world_link(Mailbox(store, f"localsgd/async/{run_id}/{key}", timeout_s), p2p)
            self.link.simulated = self.comm.link  # comm.simulate: its transfers slowed too
        self.resume_state = None  # () -> json: where a restarted process resumes (sessions)
        self.welcome: dict | None = None  # a hosted syncer's first answer (`rejoin.join`)
        self.rejoins = 0  # sessions opened again after one failed
        self.stopped = False  # the hosted syncer ended the run before this worker's last step
        # a hosted syncer's last meeting answer (who writes, whether the run stops, the global
        # model's checksum, the syncer's record), how many there were, the syncer's state if
        # this worker writes
        self.meeting: dict = {}
        self.meetings = 0
        self.syncer_state: dict | None = None
        self.stop_requested: Callable[[], bool] = lambda: False  # asks a meeting to stop
        self.align_until: float | None = None  # this phase ends here (`_phase_ends`)
        # where phases by steps end: the synchronous rounds' rule (moved by an aligned phase)
        self.phases = PhaseGrid(self.schedule, fragments, warmup_steps)
        self.seq = 0
        # each fragment's version this worker's anchor holds, the samples trained since its
        # last sync, and the fragment the next phase sends
        self.versions = [0] * fragments
        self.unsynced = [0.0] * fragments
        self.turn = 0
        self.clock = 0.0  # modelled seconds since the warmup (or wall seconds)
        self.computed = 0  # the ticks since the warmup this worker computed
        self.phase_steps = 0
        self.phase_time = 0.0
        self.phase_samples = 0.0
        self.phase_means: deque[float] = deque(maxlen=3)  # wall clock: the last phases' steps
        self.exchanges = {"p2p": 0, "collective": 0, "unchanged": 0}
        self.wait_s = 0.0
        self._tick_start = time.perf_counter()
        self.service: SyncerService | None = None
        opt = self.rounds.outer.optimizers[0]
        self.syncer_sgd = {
            **{k: opt.defaults[k] for k in ("lr", "momentum", "nesterov")},
            "warmup_rounds": self.rounds.outer.warmup_rounds,
        }
        if outer_delay is not None:
            self.syncer_sgd.update(optimizer=DelayedNesterov, delay=outer_delay)
        self.min_quorum, self.grace_s = min_quorum, grace_s
        self.announced = False
        # exchanges in flight (`in_flight`): where an answer lands and how
        self.delay, self.merge_rule, self.merge_alpha = delay_steps, merge_rule, merge_alpha

    inner_periods: tuple[int, ...] | list[int] = ()  # none until `_add_inner_levels`

    def _add_inner_levels(self, inner: dict[int, int]) -> None:
        """Hierarchical levels below the asynchronous one (`inner_levels={period: group_size}`,
        narrowest first, as `StreamingAverager`'s): each a plain fp32 mean of the whole model
        within groups of contiguous workers after each step its period divides (torch's
        hierarchical rule), at every worker's same step whether it computed it or not. The
        collectives span each group only: its workers wait for each other there (a machine's
        devices), while groups run on their own clocks."""
        self.levels = [*inner_level_groups(self.comm, inner), self.comm]
        self.inner_periods = list(inner)
        self.level_stats = [CommStats() for _ in self.levels]

    def inner_level_at(self, step: int) -> int | None:
        return level_by_period(step, self.warmup_steps, self.inner_periods)

    def period_of(self, level: int) -> int:
        if level < len(self.inner_periods):
            return self.inner_periods[level]
        return super().period_of(level)

    @mirrored()  # sharded parameters: their values in the flat buffers while it runs
    def _inner_mean(self, level: int) -> None:
        self._inner_average(level)

    def extra_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """None: an adaptive period's loss goes in the headers (`fleet_period`), not in the
        buffers (its slot exists all the same: `observe_loss` sums into it)."""
        self.schedule.loss_slots(device)
        return []

    # --- the rule -------------------------------------------------------------------------------

    def round_at(self, step: int):
        return None  # no round over every rank at a step known in advance

    def next_sync(self, step: int) -> int | None:
        """The next meeting (where an agreed stop can happen): a `meet_every` step or the last."""
        last = self.max_steps - 1
        if step > last:
            return None
        if self.meet_every > 0:
            return min(last, step + (-(step + 1)) % self.meet_every)
        return last

    def _meets(self, step: int) -> bool:
        return step == self.max_steps - 1 or (
            self.meet_every > 0 and (step + 1) % self.meet_every == 0
        )

    def computes(self) -> bool:
        """Whether this worker trains the next tick (`clock.computes`; always on the wall clock
        and in the warmup)."""
        if not self.modelled or self.step < self.warmup_steps:
            return True
        return computes(self.clock, self.step - self.warmup_steps, self.step_seconds, self.step_s)

    def _phase_ends(
        self, done: int, steps: int, phase_time: float, step: int, grid: PhaseGrid | None = None
    ) -> bool:
        """Whether an inner phase of `steps` computed steps lasting `phase_time`, `done` steps
        computed in all, ends after step `step`: by steps, where the synchronous rounds would
        (`phases`: after the first and then every `period`, or as `sync.schedule=step` says),
        or by time: after the first too (the synchronous time budget's first round, torch's
        rule), then where the next step would not fit in `inner_time_s`. A phase the syncer
        asked to end early or late (`align_s`: back in step with the others) ends where its
        next step would pass that time; the steps' count goes on from there. `grid`: the
        phases' state to advance (None: this worker's own)."""
        grid = self.phases if grid is None else grid
        if self.align_until is not None and not self.modelled:
            if time.perf_counter() + phase_time / max(1, steps) < self.align_until:
                return False
            self.align_until = None
            grid.restart(done, step)
            return True
        if self.inner_time_s is None:
            return grid.ends(done, step)
        if done == 1:  # the first computed step after the warmup
            return True
        ahead = self.step_seconds if self.modelled else phase_time / max(1, steps)
        return phase_time + ahead > self.inner_time_s / self.fragments * FITS

    def _next_time(self, step: int) -> float:
        """The modelled time of this worker's next message after step `step`, where its phase
        starts afresh: which ticks it computes, and so when it sends, is known in advance."""
        clock, done, steps, phase = self.clock, self.computed, 0, 0.0
        grid = self.phases.copy()
        for s in range(step + 1, self.max_steps):
            if computes(clock, s - self.warmup_steps, self.step_seconds, self.step_s):
                done, steps = done + 1, steps + 1
                clock += self.step_seconds
                phase += self.step_seconds
                if self._phase_ends(done, steps, phase, s, grid) and not self._meets(s):
                    return _instant(clock)
            if self._meets(s):
                return _instant(clock)
        return math.inf

    @property
    def version(self) -> int:
        """The global model's version this worker holds: every fragment's merges."""
        return sum(self.versions)

    # --- the loop -----------------------------------------------------------------------------

    def trained(self, samples: float) -> None:
        self.phase_samples += samples

    def maybe_average(self) -> bool:
        if self.stopped:  # told by the syncer: the run is over (it stops after this step)
            self.step += 1
            return False
        self._bound()
        self.ensure_bound()
        step = self.step
        self.merged = self.all_in_sync = self.started_round = False
        self.last_part = None
        if step < self.warmup_steps:  # synchronous: gradients averaged, no rounds yet
            self.phase_samples = 0.0
            self.step += 1
            self._tick_start = time.perf_counter()
            return False
        if not self.announced:
            self._start()
        did = self.computes()
        now = time.perf_counter()
        if did:
            tick = self.step_seconds if self.modelled else now - self._tick_start
            self.computed += 1
            self.phase_steps += 1
            self.clock += tick
            self.phase_time += tick
        acted = False
        if self._lands(did):  # an answer in flight (`in_flight`) lands
            self._land()
            acted = True
        if self.stopped:
            self.step += 1
            return acted
        inner = self.inner_level_at(step)
        if inner is not None:  # the group's mean first: what it sends is what the group agreed
            self._inner_mean(inner)
            acted = True
        if self._meets(step):
            if did and self.inner_time_s is None and self.align_until is None:
                self.phases.ends(self.computed, step)  # the grid counts the meeting's step
            self._drain()
            self.deferred = False  # the meeting sends every fragment's samples
            if not self.stopped:
                self._exchange(MEET, step)
            acted = True
        elif did and self.deferred and self.flight is None:  # it ended while one was in flight
            self.deferred = False
            self._launch(step)
            acted = True
        elif did and self._phase_ends(self.computed, self.phase_steps, self.phase_time, step):
            if not self.delay:
                self._exchange(SEND, step)
            elif self.flight is None:
                self._launch(step)
            else:  # the last exchange still in flight: train on, send when it has landed
                self.deferred = True
            acted = True
        self.step += 1
        self._tick_start = time.perf_counter()
        return acted

    def average(self) -> None:
        """A meeting now (the end of a run that stopped before its last step)."""
        if self.stopped:
            return
        self.ensure_bound()
        if not self.announced:
            self._start()
        self._drain()
        self.deferred = False
        if not self.stopped:
            self._exchange(MEET, self.step - 1, final=True)

    @mirrored()  # sharded parameters: their values in the flat buffers while it runs
    def _start(self) -> None:
        """The syncer starts (rank 0) with the global model every worker's anchor holds, and every
        worker announces when it will first send (after a meeting: its next time)."""
        if self.syncer_address is not None:
            self.link = join(self, self.syncer_address)
        elif self.rank == 0 and self.service is None:
            # the global model every worker's anchor holds (its last answer, or the start)
            syncer = Syncer(
                self.rounds.anchors.first, self.rounds.parts, self.syncer_sgd,
                self.warmup_steps > 0, self.aggregate, self.correction, self._param_blocks(),
                self.normalized_merges, self.max_staleness,
                FleetPeriod.build(self._period_settings()),
            )  # fmt: skip
            if self._saved_syncer is not None:
                syncer.load_state_dict(self._saved_syncer)
            self.service = SyncerService(
                syncer, WorldLinks(self.link.mailbox, self.link.group, self.comm.link),
                self.world_size,
                modelled=self.modelled, timeout_s=self.timeout_s,
                min_quorum=self.min_quorum, grace_s=self.grace_s,
                # a robust rule or a correction reads each contribution: never an all-reduce
                collective_rounds=self.aggregate is None and self.correction is None,
                decoders=part_decoders(self.flat.buffers, self.rounds.parts, self.comm_dtype),
                hold_senders=not self.inner_periods,
            )  # fmt: skip
            self.service.start()
        self._send_header(ANNOUNCE, next=self._next_time(self.step - 1) if self.modelled else None)
        self.announced = True

    _saved_syncer: dict | None = None

    @property
    def final_record(self) -> dict:
        """The hosted syncer's record as of the last meeting, and who wrote at it."""
        if not self.meeting:
            return {}
        return {**self.meeting["syncer"], "async_writer": self.meeting["writer"]}

    def met_at(self, step: int) -> bool:
        """Whether step `step` ended in a hosted syncer's meeting (`meeting` is its answer)."""
        return self.meeting.get("step") == step

    def connect(self) -> dict | None:
        """Join the hosted syncer now (before the first step); its welcome."""
        if not self.announced:
            self._start()
        return self.welcome

    def _send_header(self, kind: str, **fields) -> int:
        seq, header = self._header(kind, **fields)
        self.link.mailbox.put(f"h/{self.rank}/{seq}", header, ring=True)
        return seq

    def _header(self, kind: str, **fields) -> tuple[int, dict]:
        """The next message's number and header (the kind, this worker's step length and
        `fields`)."""
        seq = self.seq
        # this worker's step length, for the adaptive grace window: modelled, or the median
        # of its last 3 phases' means on the wall clock (a phase with a freeze in it does not
        # widen the window; none before its first phase)
        step_s = self.step_seconds
        if not self.modelled:
            if self.phase_steps and kind in (SEND, MEET):  # once a phase
                self.phase_means.append(self.phase_time / self.phase_steps)
            step_s = typical_step(self.phase_means)
        self.seq += 1
        return seq, {"kind": kind, "step_s": step_s, **fields}

    def _take(self, key: str, flight=None) -> dict:
        """The message at `key`, waited for; `flight`: an exchange in flight (`in_flight`),
        whose link it comes by and whose own count takes the wait (its thread writes nothing
        of the averager's)."""
        link = self.link if flight is None else flight.link
        alive = self.service.alive if self.service is not None else link.alive
        start = time.perf_counter()
        message = link.mailbox.take(key, alive)
        if flight is None:
            self.wait_s += time.perf_counter() - start
        else:
            flight.wait_s += time.perf_counter() - start
        return message

    @mirrored()
    def _exchange(self, kind: str, step: int, final: bool = False) -> None:
        """Send this phase's contribution (or meet), then take the global model back. With a
        hosted syncer, an exchange whose session fails rejoins (`rejoin`): the buffers take the
        global model, and a meeting is tried again."""
        before = self.stats.bytes
        last = final or step == self.max_steps - 1
        while True:
            try:
                self._talk(kind, step, last)
                break
            except LINK_ERRORS:
                if self.syncer_address is None:
                    raise
                rejoin(self)
                if kind != MEET:
                    break
        self.heard = True
        self._count(len(self.levels) - 1, before)
        self.phase_samples, self.phase_time, self.phase_steps = 0.0, 0.0, 0
        if kind == SEND:
            self.turn = (self.turn + 1) % self.fragments
        self.merged = self.all_in_sync
        if kind == MEET and not self.stopped:
            if last or self.meeting.get("stop"):
                self._send_header(DONE)
                if self.service is not None:
                    self.service.join(self.timeout_s)
            else:
                self._send_header(ANNOUNCE, next=self._next_time(step) if self.modelled else None)

    def _talk(self, kind: str, step: int, last: bool) -> None:
        rounds, buffers = self.rounds, self.flat.buffers
        samples = self.phase_samples
        # a phase sends its fragment, a meeting every one: each weighed by the samples trained
        # since its last sync
        sent = list(range(self.fragments)) if kind == MEET else [self.turn]
        unsynced = [n + samples for n in self.unsynced]
        work = {f: views(buffers, rounds.parts[f]) for f in sent}
        nxt = self._next_time(step) if self.modelled and kind == SEND else None
        resume = self.resume_state() if self.resume_state is not None and kind == SEND else None
        seq = self._send_header(
            kind, time=_instant(self.clock) if self.modelled else None, samples=samples,
            fragments=sent, weights=[unsynced[f] for f in sent], versions=list(self.versions),
            next=nxt, resume=resume, last=last, step=step,
            stop=kind == MEET and self.stop_requested(), **self._loss_report(last),
        )  # fmt: skip
        decision = self._take(f"d/{self.rank}/{seq}")
        if decision["do"] == "stop":  # a hosted syncer's run ended without this worker
            self.stopped = True
            return
        # an adaptive period: the syncer's decision, in its decision or its answer (so its next
        # phase's end, announced in advance under the modelled clock, moves)
        moved = self._take_period(decision)
        waited = False  # for its answer past its send time (modelled)
        self.unsynced = [0.0 if f in work else n for f, n in enumerate(unsynced)]
        # every worker is here (a meeting, or a synchronous round, of a fragment as in the
        # synchronous schedule): the global-sync hooks (drift) run around it, their collectives
        # in the same order on every rank
        # (a sharded replica group's shards merge apart: on the wall clock each shard's syncer
        # may merge at another moment, so its hooks, whose collectives span the group, run at
        # meetings only)
        together = kind == MEET or (
            decision["do"] == "collective" and (self.modelled or not self.sharded)
        )
        if together:
            self._global_hooks("before")
        # the pseudo-gradients, in place (zeros where nothing was trained since the last
        # answer): the buffers take the global values back after
        for f, w in work.items():
            rounds.offer(f, buffers, w)
        if decision["do"] == "collective":
            self._collective(decision, work, [unsynced[f] for f in sent])
            # on the wall clock a sharded group's shards may round apart: checked at meetings
            self.all_in_sync = self.all_in_sync and (together or kind == MEET)
            self.exchanges["collective"] += 1
            for f in work:
                self.versions[f] = decision["versions"][f]
            if kind == MEET and self.modelled:  # every worker leaves a meeting at its time
                self.clock = decision["time"]
        else:
            if decision["do"] == "payload":
                for f, w in work.items():
                    nbytes, seconds = self._send_payload(w, f)
                    self.stats.bytes += nbytes
                    self.stats.seconds += seconds
            answer = self._take(f"r/{self.rank}/{seq}")
            if answer["values"]:
                self._receive_values([t for w in work.values() for t in w])
                self.exchanges["p2p"] += 1
            else:  # the global values are still this worker's anchor
                anchors = rounds.anchors.first
                for f, w in work.items():
                    for t, a in zip(w, views(anchors, rounds.parts[f]), strict=True):
                        t.copy_(a)
                self.exchanges["unchanged"] += 1
            for f, w in work.items():
                rounds.anchors.settle_(rounds.parts[f], 0, w)
            for f in work:  # the other fragments' anchors are as old as before
                self.versions[f] = answer["versions"][f]
            moved = self._take_period(answer) or moved
            waited = self.modelled and answer["time"] > _instant(self.clock)
            if waited:  # at a meeting, or for its merge (sync.grace_s): idle until then
                self.clock = answer["time"]
            self.all_in_sync = kind == MEET
            if answer.get("align_s") is not None:  # out of step with the others: rejoin them
                self.align_until = time.perf_counter() + answer["align_s"]
            if "syncer" in answer:  # a hosted syncer's meeting: its record, maybe its state
                self.meeting, self.meetings = {**answer, "step": step}, self.meetings + 1
                if answer["writer"] == self.rank:
                    self.syncer_state = tree_from_json(
                        answer["state"], lambda t: self.link.recv(t, TAG_VALUES)
                    )
        if (waited or moved) and kind == SEND and self.modelled:
            # its next message comes later (or, at a shorter period, sooner) than it said
            self._send_header(ANNOUNCE, next=self._next_time(step))
        if together:
            self._global_hooks("after")
        # the hooks after each exchange, where the worker took the newest global values (no
        # collective: `sync.optimizer_state=reset` drops its inner optimizer's state; the modes
        # that average the state are refused)
        for f in work:
            self._run_hooks(self.comm, len(self.levels) - 1, f if self.fragments > 1 else None)

    def _period_settings(self) -> dict | None:
        """The syncer's adaptive period (`fleet_period`), from this worker's schedule."""
        return FleetPeriod.settings_of(
            self.schedule, self.workers, self.fragments, robust=self.aggregate is not None
        )

    def _loss_report(self, last: bool) -> dict:
        """An adaptive period's fields of a contribution's header: this worker's mean training
        loss since its last exchange with the steps behind it (None: none, or its `last`
        exchange, after which no period is needed, as after the synchronous rounds' final
        average), and the period it trained at (`fleet_period`); nothing for another schedule."""
        schedule = self.schedule
        if not schedule.needs_loss:
            return {}
        loss = None
        if schedule.loss_count > 0 and not last:
            loss = [float((schedule.loss_slot / schedule.loss_count).item()), schedule.loss_count]
            schedule.loss_slot.zero_()
            schedule.loss_count = 0
        return {"loss": loss, "period": schedule.period}

    def _take_period(self, message: dict) -> bool:
        """The syncer's adaptive period, where `message` carries it; whether it changed."""
        period = message.get("period")
        if period is None or period == self.schedule.period:
            return False
        self.schedule.period = int(period)
        return True

    def _collective(self, decision: dict, work: dict[int, list], weights: list[float]) -> None:
        """A synchronous round of the fragments in `work`: each one's mean all-reduced
        (weighted by samples where they differ), the outer steps on rank 0's syncer, the new
        global values broadcast."""
        rounds, comm = self.rounds, self.comm
        totals = []
        for (f, w), weight in zip(work.items(), weights, strict=True):
            # the samples behind the mean: every worker's weight (all alike unweighted)
            every = comm.weigh(weight, w[0].device) if decision["weighted"] else None
            totals.append(sum(every) if every else weight * self.world_size)
            try:
                rounds.combine.blocking(f, w, comm, rounds.wires[f])
            finally:
                comm.unweigh()
        if self.service is not None:
            self.service.collective_merged(
                list(work.values()), totals, decision["workers"], list(work)
            )
        for w in work.values():
            for t in w:
                comm.broadcast_(t)
        for f, w in work.items():
            rounds.anchors.settle_(rounds.parts[f], 0, w)
        self.all_in_sync = len(work) == self.fragments

    def _send_payload(self, work: list, f: int) -> tuple[int, float]:
        """Fragment f's contribution in the wire's format (`messages`); rank 0's goes
        in-process. Returns the bytes sent and the seconds it took."""
        start = time.perf_counter()
        sent = [] if counts_senders(self.comm_dtype) else None
        messages, decoded = encode_(work, self.rounds.wires[f], sent)
        if self.service is not None:  # as the syncer decodes the others': in the buffers' dtype
            self.service.payload.put((
                [d.detach().to(w.dtype, copy=True) for d, w in zip(decoded, work, strict=True)],
                sent,
            ))  # fmt: skip
        else:  # through host memory: the point-to-point group is gloo's, on every device
            for m in messages:
                self.link.send(m.detach().cpu().contiguous(), TAG_PAYLOAD)
        return sum(m.numel() * m.element_size() for m in messages), time.perf_counter() - start

    def _receive_values(self, work: list) -> None:
        if self.service is None:
            self.link.receive_model(work)
            return
        values = self.service.values.get(timeout=self.timeout_s)
        for w, v in zip(work, values, strict=True):
            w.copy_(v)

    # --- state ----------------------------------------------------------------------------------

    def summary(self) -> dict:
        out = {
            "async_exchanges": dict(self.exchanges),
            "async_wait_s": round(self.wait_s, 3),
            "async_version": self.version,
        }
        if self.syncer_address is not None:
            out["async_rejoins"] = self.rejoins
        if self.service is not None:
            out.update(self.service.record())
        out.update(self.final_record)
        return out

    def _param_blocks(self) -> list[tuple[int, int, int]]:
        """HeLoCo's blocks: each parameter's (buffer, offset, numel) in the flat buffers."""
        return [
            slot
            for t, slot in zip(self.flat.tensors, self.flat.slots, strict=True)
            if isinstance(t, torch.nn.Parameter)
        ]

    def state_dict(self) -> dict:
        if not self.all_in_sync and self.step > self.warmup_steps:
            raise RuntimeError("asynchronous rounds checkpoint at meetings only")
        state = super().state_dict()
        state["async"] = {
            "versions": list(self.versions), "clock": self.clock,
            "exchanges": dict(self.exchanges), "computed": self.computed, "turn": self.turn,
            "unsynced": list(self.unsynced), "phases": self.phases.state_dict(),
        }  # fmt: skip
        if self.service is not None:
            with self.service.lock:
                state["async"]["syncer"] = self.service.syncer.state_dict()
        elif self.syncer_state is not None:  # a hosted syncer's, sent for this checkpoint
            state["async"]["syncer"] = self.syncer_state
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        saved = state.get("async", {})
        versions = saved.get("versions", [saved.get("version", 0)])
        if len(versions) != self.fragments:
            raise ValueError(
                f"the checkpoint has sync.fragments={len(versions)}, this run {self.fragments}"
            )
        self.versions = [int(v) for v in versions]
        self.turn = int(saved.get("turn", 0))
        self.unsynced = [float(n) for n in saved.get("unsynced", [0.0] * self.fragments)]
        self.clock = float(saved.get("clock", 0.0))
        self.computed = int(saved.get("computed", 0))
        if "phases" in saved:
            self.phases.load_state_dict(saved["phases"])
        self.exchanges.update(saved.get("exchanges", {}))
        self._saved_syncer = saved.get("syncer")


def _point_to_point(group: dist.ProcessGroup | None, timeout_s: float):
    """The gloo group the workers of `group` (None: every rank) and their syncer move tensors
    on, apart from the training's collectives so that a thread's sends never meet them, and the
    key of their messages. Sharded replica groups average each shard among the ranks holding
    it: each such group gets its own, keyed by its first rank (every rank takes part in making
    them all, as `new_subgroups_by_enumeration` needs)."""
    timeout = timedelta(seconds=timeout_s)
    # virtual workers (threads of one process) move tensors through their own group's store
    backend = VIRTUAL_BACKEND if dist.get_backend() == VIRTUAL_BACKEND else "gloo"
    if group is None:
        return dist.new_group(backend=backend, timeout=timeout), ""
    groups = parallel_groups(group)
    p2p, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout, backend=backend)
    return p2p, f"g{dist.get_process_group_ranks(group)[0]}/"

"""A worker cut off from its peers drops itself: it heartbeats to torchft's lighthouse only while
it is healthy.

Why (torchft 0.2.0's `src/lighthouse.rs`, `quorum_compute`): a quorum forms at once when every
member of the last one has joined; otherwise the lighthouse waits up to its join timeout from
the earliest joiner while any replica whose heartbeat it heard within the heartbeat timeout has
not joined. The Manager's heartbeats come from its Rust ManagerServer's own task, whatever the
worker's training thread does, so a worker whose data plane is cut (its collectives send
nothing) or whose training thread hangs holds every quorum of the others for the join timeout.

So the Manager is built with a heartbeat interval of a year (its task sends one heartbeat at
start, then sleeps), and `GatedHeartbeats`, a thread of ours, heartbeats every `interval_s`
with `torchft._torchft.LighthouseClient.heartbeat(full_id)` while the `HeartbeatGate` is open.
`full_id` is the id the lighthouse knows, `replica_id:uuid` (the Manager appends a fresh uuid
and keeps the whole in its store under `replica_id`): heartbeating the bare id would make a
phantom member that never joins and holds every quorum for the join timeout.

The gate (`HeartbeatGate`) closes when

- a collective of a round fails or times out (`failed`); it reopens at the worker's next step
  or quorum request: a failure is seen by every member of the round alike (a ring all-reduce
  times out on every member when one is cut), so a failure alone never keeps a worker out;
- the training thread makes no progress for `stall_s`: no optimizer step (the `watch`ed probe,
  the averager's step), no collective completed, no quorum returned. Inside a round, until the
  worker's next step, the allowance is the round's grace window if shorter: that is how long
  its peers' collectives wait for it, so a worker that is late by more than that has failed the
  round for them already. Time spent inside a collective (it has its own timeout, and its
  failure closes the gate) or inside a quorum request is no stall, nor is anything before the
  worker's first step but a round (a first step may compile the model).

It never closes inside a quorum request, and heartbeats there even when it was closed: the
lighthouse counts a joined member only while its heartbeats are fresh, so a worker that stopped
heartbeating inside its quorum request would be left out of the quorum it asked for.

The others' next quorum then forms without the cut worker once its last heartbeat is older than
the lighthouse's heartbeat timeout: a cut inside a round costs them the round's grace window
plus that timeout at most. The cut worker, back, trains on (its gate reopens), joins its next
quorum, finds itself behind and heals from a live peer.

A replica group of several processes (torchrun) has one ManagerServer, on its rank 0, so only
rank 0 heartbeats, and its gate must reflect every rank: each other rank bumps a counter in the
group's store (`GroupBeats`) on every tick its own gate is open, and rank 0 heartbeats only
while its own gate is open and every rank's counter moved within `stale_s` of its own clock (a
counter, not a timestamp: no clocks are compared).

No torch or torchft import at module import: the gate's logic is tested on its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = [
    "GatedHeartbeats",
    "GroupBeats",
    "HeartbeatGate",
    "Ungated",
    "full_replica_id",
    "gate_heartbeats",
]

# The Manager's own heartbeat interval under a gate: its task heartbeats once at start, then
# sleeps this long (tokio clamps a far deadline; a job never sees the second beat).
MANAGER_HEARTBEAT = timedelta(days=365)


class HeartbeatGate:
    """Whether this worker is healthy enough to be counted on: `is_open()`, read by the
    heartbeat thread. The training thread reports `progress()`, `failed(why)`, and brackets its
    quorum requests (`quorum_request()`) and collective waits (`waiting()`); `in_round(window)`
    at a round's start and `in_round(None)` at its end. `clock`: for tests."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        if not stall_s > 0:
            raise ValueError(f"a stall window must be > 0 s, got {stall_s}")
        self.stall_s, self.clock = stall_s, clock
        self._lock = threading.Lock()
        self._last = clock()  # the last progress seen
        self._quorum = 0  # quorum requests in flight (the training thread's, and healing)
        self._waiting = 0  # collectives in flight
        self._window: float | None = None  # inside a round: its grace window
        self._window_at: Any = None  # ... which holds until the probe moves (the next step)
        self._probe: Callable[[], Any] | None = None
        self._seen: Any = None
        self._stepped = False  # the probe moved once: the first step (a compile) is behind
        self.closed: str | None = None  # why the gate is closed; None: open
        self.closes = 0  # times it closed
        self.closed_s = 0.0  # seconds it stayed closed, over the closes that reopened
        self._closed_at = 0.0

    # --- what the training thread reports ------------------------------------------------------

    def watch(self, probe: Callable[[], Any]) -> None:
        """Count a change of `probe()` (e.g. the averager's step) as progress."""
        with self._lock:
            self._probe, self._seen = probe, probe()

    def progress(self) -> None:
        with self._lock:
            self._progressed()

    def failed(self, why: str) -> None:
        """A collective failed or timed out: closed now (never inside a quorum request)."""
        with self._lock:
            if not self._quorum:
                self._close(why)

    def in_round(self, window_s: float | None) -> None:
        """A round started, its collectives waiting `window_s` for a peer (None: it ended)."""
        with self._lock:
            self._window = window_s
            self._window_at = self._probe() if self._probe is not None else None

    @contextlib.contextmanager
    def quorum_request(self):
        """Inside: open, whatever it was (a quorum request is the worker asking to be counted
        on); when the request returns, that is progress."""
        with self._lock:
            self._quorum += 1
        try:
            yield
        finally:
            with self._lock:
                self._quorum -= 1
                self._progressed()

    @contextlib.contextmanager
    def waiting(self):
        """Inside a collective's wait: no stall accrues (the collective has its own timeout,
        and its failure closes the gate)."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                self._last = self.clock()

    # --- what the heartbeat thread reads -------------------------------------------------------

    def is_open(self) -> bool:
        with self._lock:
            if self._quorum:
                return True
            if self._probe is not None:
                seen = self._probe()
                if seen != self._seen:
                    self._seen, self._stepped = seen, True
                    self._progressed()
            if self.closed is None and not self._waiting:
                allowance = self._allowance()
                idle = self.clock() - self._last
                # before its first step a worker may compile or start its data loaders: only a
                # round's window applies then
                armed = self._stepped or self._probe is None or allowance < self.stall_s
                if armed and idle > allowance:
                    where = "inside a round" if allowance < self.stall_s else "between rounds"
                    self._close(f"no progress for {idle:.1f} s {where}")
            return self.closed is None

    def allowance(self) -> float:
        with self._lock:
            return self._allowance()

    # --- inside the lock -------------------------------------------------------------------------

    def _allowance(self) -> float:
        if self._window is None:
            return self.stall_s
        if self._probe is not None and self._probe() != self._window_at:
            return self.stall_s  # a round open across steps (a delayed merge): steps are progress
        return min(self.stall_s, self._window)

    def _progressed(self) -> None:
        self._last = self.clock()
        if self.closed is not None:
            self.closed = None
            self.closed_s += self._last - self._closed_at

    def _close(self, why: str) -> None:
        if self.closed is None:
            self.closed, self._closed_at = why, self.clock()
            self.closes += 1


class Ungated:
    """The gate's surface where there is none (torchft's own heartbeats): always open."""

    closed = None
    closes = 0
    closed_s = 0.0

    def watch(self, probe) -> None:
        pass

    def progress(self) -> None:
        pass

    def failed(self, why: str) -> None:
        pass

    def in_round(self, window_s) -> None:
        pass

    def quorum_request(self):
        return contextlib.nullcontext()

    def waiting(self):
        return contextlib.nullcontext()

    def is_open(self) -> bool:
        return True


class GroupBeats:
    """A replica group's ranks in one gate: rank r > 0 `publish()`es (bumps its counter in the
    group's store) on every tick its own gate is open; rank 0's `healthy()` is whether every
    other rank's counter moved within `stale_s`, by rank 0's clock. `store`: anything with
    `torch.distributed.Store.add(key, amount) -> int` (add 0 reads without blocking)."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        stale_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        prefix: str = "localsgd/gate",
    ):
        self.store, self.rank, self.size = store, rank, size
        self.stale_s, self.clock, self.prefix = stale_s, clock, prefix
        now = clock()
        self._seen = {r: (None, now) for r in range(1, size)}  # rank: (counter, moved at)
        self.stale: list[int] = []  # the ranks the last `healthy()` found stale

    def key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def publish(self) -> None:
        self.store.add(self.key(self.rank), 1)

    def healthy(self) -> bool:
        now, stale = self.clock(), []
        for rank, (last, moved) in self._seen.items():
            value = self.store.add(self.key(rank), 0)
            if value != last:
                self._seen[rank] = (value, now)
            elif now - moved > self.stale_s:
                stale.append(rank)
        self.stale = stale
        return not stale


def full_replica_id(manager) -> str:
    """The id the lighthouse knows this replica group by, `replica_id:uuid`: the Manager's
    store key `replica_id` (its `_replica_id` is the bare one)."""
    from torchft.manager import REPLICA_ID_KEY

    return manager._store.get(REPLICA_ID_KEY).decode("utf-8")


class GatedHeartbeats:
    """The heartbeat thread of one rank: every `interval_s`, if `gate.is_open()` (and, on a
    group's rank 0, every rank's beat is fresh: `group`), rank 0 heartbeats `replica_id` to the
    lighthouse and any other rank publishes its beat. `on_change(open, why)` is called from
    this thread when the group's gate closes or reopens. `client`: a LighthouseClient (built
    from `lighthouse` when None); only rank 0 needs one."""

    def __init__(
        self,
        gate: HeartbeatGate,
        *,
        replica_id: str | None,
        lighthouse: str | None = None,
        interval_s: float = 0.1,
        timeout_s: float = 5.0,
        group: GroupBeats | None = None,
        client=None,
        on_change: Callable[[bool, str], None] | None = None,
    ):
        self.gate, self.replica_id, self.group = gate, replica_id, group
        self.interval_s, self.timeout = interval_s, timedelta(seconds=timeout_s)
        self.leads = group is None or group.rank == 0  # heartbeats to the lighthouse
        if client is None and self.leads:
            from torchft._torchft import LighthouseClient

            client = LighthouseClient(lighthouse, timedelta(seconds=timeout_s))
        self.client, self.on_change = client, on_change
        self.sent = 0  # heartbeats sent
        self.failures = 0  # heartbeats the lighthouse did not take (it is down or slow)
        self.open = True  # what the last tick decided
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="localsgd_heartbeat", daemon=True)

    def start(self) -> GatedHeartbeats:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 1.0)  # a daemon: it dies with us

    def tick(self) -> bool:
        """One tick (the thread's loop body): whether it beat."""
        own = self.gate.is_open()
        beats = own
        why = self.gate.closed or ""
        if self.group is not None and own:
            try:
                if self.leads:
                    beats = self.group.healthy()
                    why = f"rank {', '.join(map(str, self.group.stale))} of its group stalled"
                else:
                    self.group.publish()
            except Exception as e:  # the group's store is gone: rank 0's process died
                beats, why = False, f"its group's store failed ({type(e).__name__})"
        if beats != self.open:
            self.open = beats
            if self.on_change is not None:
                self.on_change(beats, why)
        if beats and self.leads:
            try:
                self.client.heartbeat(self.replica_id, timeout=self.timeout)
                self.sent += 1
            except Exception:  # the lighthouse is down or slow: the quorum will say so
                self.failures += 1
        return beats

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.interval_s)


def gate_heartbeats(
    manager,
    gate: HeartbeatGate,
    lighthouse: str,
    interval_s: float,
    timeout_s: float,
    group: tuple[str, int, int, int] | None = None,
    on_change: Callable[[bool, str], None] | None = None,
) -> GatedHeartbeats:
    """Start the heartbeat thread of this rank of `manager` (built with `MANAGER_HEARTBEAT`),
    kept as `manager.localsgd_heartbeats`; `manager.shutdown()` stops it first. `group`:
    `(store_addr, store_port, rank, size)` of a replica group of several processes, whose store
    carries the ranks' beats (a client of its own: the Manager's is the training thread's)."""
    beats = None
    if group is not None:
        import torch.distributed as dist

        addr, port, rank, size = group
        store = dist.TCPStore(
            addr, port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=min(timeout_s, 5.0)),
        )  # fmt: skip
        beats = GroupBeats(store, rank, size, stale_s=max(1.0, 10 * interval_s))
    leads = beats is None or beats.rank == 0
    thread = GatedHeartbeats(
        gate,
        replica_id=full_replica_id(manager) if leads else None,
        lighthouse=lighthouse,
        interval_s=interval_s,
        timeout_s=min(timeout_s, 5.0),
        group=beats,
        on_change=on_change,
    ).start()
    manager.localsgd_heartbeats = thread
    shutdown = manager.shutdown

    def stop_then_shutdown(wait: bool = True) -> None:
        thread.stop()  # no heartbeat of a finished worker holds anyone's quorum
        shutdown(wait=wait)

    manager.shutdown = stop_then_shutdown
    return thread

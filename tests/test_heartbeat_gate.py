"""A worker cut off from its peers drops itself (`ft.heartbeat_gate`, `ft.stall_s`): it heartbeats
to torchft's lighthouse only while it is healthy (localsgd.averaging.torchft.heartbeat_gate).

- the gate's logic on a fake clock: it closes on a failed collective and after `stall_s` without
  progress (inside a round, after the round's grace window), reopens on progress, never closes
  inside a quorum request and accrues no stall inside a collective's wait;
- a replica group's ranks in one gate (`GroupBeats`), and the heartbeat thread's tick;
- in one process against torchft's own lighthouse: the Manager's id with its uuid is what is
  heartbeated, never the bare one (which would be a phantom member); and three replicas, one of
  them cut inside a round while its process runs on: the others' next quorum forms after about
  one window plus the heartbeat timeout, not the join timeout nor the cut, and the cut one
  rejoins, heals from a live peer and holds the others' value after the next round;
- end to end (`-m long`): the same with the CLI, 3 workers, `tests/faults.py`'s partition.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from localsgd.averaging.torchft.heartbeat_gate import (
    GatedHeartbeats,
    GroupBeats,
    HeartbeatGate,
)
from tests.helpers import cli, listening, three_paced_workers_under_ft


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_progress_the_gate_closes_after_the_stall_window_and_progress_reopens_it():
    clock = Clock()
    gate = HeartbeatGate(stall_s=5.0, clock=clock)
    clock.now += 4.9
    assert gate.is_open()
    clock.now += 0.2
    assert not gate.is_open() and "no progress for 5.1 s between rounds" in gate.closed
    clock.now += 3.0
    gate.progress()
    assert gate.is_open() and gate.closes == 1 and gate.closed_s == pytest.approx(3.0)


def test_a_step_is_progress():
    clock, step = Clock(), [0]
    gate = HeartbeatGate(stall_s=5.0, clock=clock)
    gate.watch(lambda: step[0])
    for _ in range(10):  # a step every 3 s: never 5 s without one
        clock.now += 3.0
        step[0] += 1
        assert gate.is_open()
    clock.now += 5.1
    assert not gate.is_open()
    step[0] += 1
    assert gate.is_open()


def test_before_its_first_step_only_a_rounds_window_closes_the_gate():
    """A first step may compile the model (`trainer.compile`) on every worker at once: were
    their gates to close, the first worker done would find nobody heartbeating and form a
    quorum alone."""
    clock, step = Clock(), [0]
    gate = HeartbeatGate(stall_s=5.0, clock=clock)
    gate.watch(lambda: step[0])
    clock.now += 60.0
    assert gate.is_open()
    gate.in_round(2.0)  # inside a round its peers wait one window for it, first step or not
    clock.now += 2.1
    assert not gate.is_open()
    gate.in_round(None)
    step[0] += 1
    assert gate.is_open()
    clock.now += 5.1
    assert not gate.is_open()  # after it: stall_s


def test_inside_a_round_the_allowance_is_the_rounds_window_until_the_next_step():
    """Its peers wait one window for it in the round: late by more, it has failed the round for
    them already. A round that stays open across steps (a delayed merge) is back to stall_s."""
    clock, step = Clock(), [0]
    gate = HeartbeatGate(stall_s=30.0, clock=clock)
    gate.watch(lambda: step[0])
    gate.in_round(2.0)
    assert gate.allowance() == 2.0
    clock.now += 2.1
    assert not gate.is_open() and "inside a round" in gate.closed
    gate.progress()
    step[0] += 1  # the worker trained on while the round stays open
    clock.now += 10.0
    assert gate.is_open() and gate.allowance() == 30.0
    gate.in_round(None)
    assert gate.allowance() == 30.0
    gate.in_round(60.0)
    assert gate.allowance() == 30.0  # never above stall_s


def test_the_gate_never_closes_inside_a_quorum_request_and_is_open_there_even_after_a_failure():
    """The lighthouse counts a joined member only while its heartbeats are fresh: a worker that
    stopped heartbeating inside its quorum request would be left out of the quorum it asked
    for."""
    clock = Clock()
    gate = HeartbeatGate(stall_s=1.0, clock=clock)
    gate.failed("a collective failed")
    assert not gate.is_open()
    with gate.quorum_request():
        assert gate.is_open()  # asking to be counted on: heartbeats
        clock.now += 50.0  # the quorum waits for the others
        gate.failed("anything")  # ignored inside
        assert gate.is_open()
    assert gate.is_open()  # the quorum came back: progress
    clock.now += 1.1
    assert not gate.is_open()


def test_a_failed_collective_closes_at_once_and_a_wait_accrues_no_stall():
    clock = Clock()
    gate = HeartbeatGate(stall_s=1.0, clock=clock)
    gate.in_round(1.0)
    with gate.waiting():  # e.g. the count waiting for a heal with ft.timeout_s
        clock.now += 20.0
        assert gate.is_open()
    assert gate.is_open()  # the wait ended just now
    gate.failed("a collective failed (RuntimeError)")
    assert not gate.is_open() and gate.closed.startswith("a collective failed")
    gate.progress()
    assert gate.is_open()
    with pytest.raises(ValueError):
        HeartbeatGate(stall_s=0)


class DictStore:
    """`torch.distributed.Store.add` on a dict."""

    def __init__(self):
        self.values: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


class Recording:
    def __init__(self):
        self.ids: list[str] = []

    def heartbeat(self, replica_id, timeout=None):
        self.ids.append(replica_id)


def test_a_group_heartbeats_only_while_every_rank_is_healthy():
    """Rank 0 of a replica group of 3 heartbeats for the group: only while its own gate is open
    and the other ranks' beats move (each bumps its counter while its own gate is open)."""
    clock, store = Clock(), DictStore()
    gates = [HeartbeatGate(stall_s=5.0, clock=clock) for _ in range(3)]
    client, changes = Recording(), []
    threads = [
        GatedHeartbeats(
            gates[r],
            replica_id="group_1:uuid" if r == 0 else None,
            group=GroupBeats(store, r, 3, stale_s=1.0, clock=clock),
            client=client if r == 0 else None,
            on_change=lambda open_, why: changes.append((open_, why)),
        )
        for r in range(3)
    ]

    def tick(ranks=(0, 1, 2), seconds=0.1):
        clock.now += seconds
        for r in ranks:
            threads[r].tick()

    for _ in range(5):
        tick()
    assert client.ids == ["group_1:uuid"] * 5
    for r in range(3):
        gates[r].progress()
    gates[2].failed("a collective failed")  # rank 2's own gate closed: it stops beating
    for _ in range(15):
        tick(seconds=0.1)
        gates[0].progress()
        gates[1].progress()
    assert len(client.ids) < 5 + 15 and not threads[0].open
    assert changes[-1] == (False, "rank 2 of its group stalled")
    gates[2].progress()
    tick()
    tick()
    assert threads[0].open and changes[-1][0] is True
    # rank 1 frozen (its thread ticks no more): the same after stale_s
    sent = len(client.ids)
    for _ in range(15):
        tick(ranks=(0, 2))
        gates[0].progress()
        gates[2].progress()
    assert not threads[0].open and len(client.ids) < sent + 15
    assert changes[-1] == (False, "rank 1 of its group stalled")

    class Gone:
        def add(self, key, amount):
            raise RuntimeError("connection refused")

    threads[1].group.store = Gone()  # rank 0's process (the store's host) died
    gates[1].progress()
    assert threads[1].tick() is False  # no exception escapes the thread
    assert not threads[1].open and changes[-1] == (False, "its group's store failed (RuntimeError)")


def test_the_heartbeat_thread_beats_only_while_the_gate_is_open():
    clock, client, changes = Clock(), Recording(), []
    gate = HeartbeatGate(stall_s=1.0, clock=clock)
    beats = GatedHeartbeats(
        gate,
        replica_id="replica_002:0c4e",
        client=client,
        on_change=lambda open_, why: changes.append((open_, why)),
    )
    for _ in range(3):
        beats.tick()
    gate.failed("a collective failed (RuntimeError)")
    for _ in range(3):
        assert not beats.tick()
    gate.progress()
    beats.tick()
    assert client.ids == ["replica_002:0c4e"] * 4
    assert changes == [(False, "a collective failed (RuntimeError)"), (True, "")]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_full_replica_id_is_heartbeated_and_the_manager_beats_once():
    """torchft's Manager appends a uuid to the replica id and the lighthouse knows the group by
    the whole (`replica_id:uuid`): that is what the thread heartbeats. The bare id would be a
    member of its own that never joins, and the lighthouse would wait for it at every quorum."""
    from localsgd.averaging.torchft import make_manager, start_lighthouse
    from localsgd.averaging.torchft.heartbeat_gate import MANAGER_HEARTBEAT

    server, lighthouse = start_lighthouse(1, heartbeat_timeout_ms=500)
    try:
        manager = make_manager(
            replica_id="replica_000", lighthouse=lighthouse, gate=HeartbeatGate(5.0), timeout_s=10
        )
        try:
            beats = manager.localsgd_heartbeats
            stored = manager._store.get("replica_id").decode()
            assert beats.replica_id == stored != manager._replica_id == "replica_000"
            assert stored.startswith("replica_000:") and len(stored) > len("replica_000:") + 30
            # the replica group's store (it names the Manager's address) on the loopback only
            assert listening(manager._localsgd_store.port) == ["0100007F"]
            deadline = time.monotonic() + 10
            while beats.sent < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert beats.sent >= 3 and beats.failures == 0
            assert MANAGER_HEARTBEAT.days >= 365
        finally:
            manager.shutdown(wait=False)
        assert not beats._thread.is_alive()  # shutdown stops our heartbeats too
    finally:
        server.shutdown()


def _replica(index, lighthouse, gated, cut_s, out):
    """One replica of three, each in its own thread with its own Manager and gate: a round is a
    quorum, an average of its value and a commit; between rounds it trains (its value + 1, a
    step). Replica 2 is cut inside round 1: it holds its collectives for `cut_s` while its
    process (and heartbeat thread) runs on. Records each round's (start, end, committed,
    participants) and, after every round, its value."""
    from localsgd.averaging.torchft import GraceWindow, TorchftCommunicator, make_manager

    gate = HeartbeatGate(stall_s=30.0) if gated else None
    manager = make_manager(
        replica_id=f"replica_{index:03d}", lighthouse=lighthouse, min_replicas=1,
        timeout_s=15.0, quorum_timeout_s=20.0, gate=gate,
    )  # fmt: skip
    comm = TorchftCommunicator(
        manager, replicas=3, grace=GraceWindow(fixed_s=0.5, max_s=15.0), gate=gate
    )
    value, step = [torch.full((8,), float(index))], [0]

    def load(state):  # a heal: the peer's value; it contributes nothing in that round
        value[0] = state.clone()
        comm.healed = True

    manager.register_state_dict_fn("value", load, lambda: value[0])
    if gate is not None:
        gate.watch(lambda: step[0])
    rounds, healed = [], False
    try:
        joined = time.monotonic() + 20
        while time.monotonic() < joined:  # nobody trains alone while the others start
            comm.begin()
            if comm.commit() and comm.participants == 3:
                break
            time.sleep(0.02)
        for round_ in range(40):
            start = time.monotonic()
            comm.begin(samples=1)
            healed = healed or comm.healed
            if index == 2 and round_ == 1:
                time.sleep(cut_s)  # the cut: nothing sent, heartbeats on
            flat = value[0].clone()
            comm.mean_(flat)
            ok = comm.commit()
            if ok:
                value[0] = flat
            rounds.append((start, time.monotonic(), ok, comm.participants))
            if round_ > 1 and ok and comm.participants == 3:
                break  # all three again after the cut (and the heal): the same round for each
            time.sleep(0.1)  # training
            value[0] = value[0] + 1
            step[0] += 1
        out[index] = {"rounds": rounds, "healed": healed, "value": value[0].clone(),
                      "closes": comm.gate.closes}  # fmt: skip
    finally:
        manager.shutdown(wait=False)


def _three_replicas(gated: bool, cut_s: float) -> dict:
    from localsgd.averaging.torchft import start_lighthouse

    server, lighthouse = start_lighthouse(
        1, heartbeat_timeout_ms=500, join_timeout_ms=20_000, quorum_tick_ms=20
    )
    out = {}
    threads = [
        threading.Thread(target=_replica, args=(i, lighthouse, gated, cut_s, out), daemon=True)
        for i in range(3)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)
    finally:
        server.shutdown()
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_replica_cut_inside_a_round_drops_itself_and_heals():
    """Three replicas in one process (torchft's lighthouse, 0.5-s heartbeat timeout, a 20-s join
    timeout; rounds with a 0.5-s window). Replica 2 holds round 1's collectives for 3 s while
    its heartbeat thread runs on. Its gate closes one window into the round, so replica 0's
    failed round 1 is followed by a quorum of the other two within about the window plus the
    heartbeat timeout (here under 2 s), not the 3-s cut nor the join timeout. Replica 2, back,
    rejoins, heals from a live peer, and after the next round all three hold the same value."""
    cut_s = 3.0
    out = _three_replicas(gated=True, cut_s=cut_s)
    assert set(out) == {0, 1, 2}, out.keys()
    first = out[0]["rounds"]
    assert first[1][2] is False  # round 1 failed on the cut
    # the next round committed by 0 and 1 without replica 2
    after = first[2]
    assert after[2] and after[3] == 2, first
    assert after[1] - first[1][0] < 2.0 < cut_s, first  # from the cut round's start
    assert out[2]["healed"] and out[2]["closes"] >= 1
    for i in (0, 1):  # never left out
        assert min(r[3] for r in out[i]["rounds"] if r[2]) >= 2, out[i]["rounds"]
    last = [out[i]["rounds"][-1] for i in range(3)]
    assert all(r[2] and r[3] == 3 for r in last), last
    assert torch.equal(out[0]["value"], out[2]["value"])
    assert torch.equal(out[1]["value"], out[2]["value"])


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(60)
def test_ungated_the_cut_replica_holds_the_others_for_the_whole_cut():
    """The same without the gate (torchft's own heartbeats): the lighthouse still hears replica 2,
    so the others' next quorum waits for it to come back: the whole cut."""
    cut_s = 3.0
    out = _three_replicas(gated=False, cut_s=cut_s)
    first = out[0]["rounds"]
    assert first[1][2] is False
    assert first[2][1] - first[1][0] > cut_s, first


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_a_partitioned_worker_drops_itself_and_heals_end_to_end(tmp_path):
    """`tests/faults.py`'s partition under ft=torchft: worker 2's collectives send nothing for 6 s
    from its round after step 40 while its process and heartbeats run on (1-s window, 1-s
    heartbeat timeout, 30-s join timeout). Its gate closes one window into the round, so the
    others' failed round is followed by a round of the two of them within the window plus the
    heartbeat timeout and slack (not the 6-s partition nor the join timeout); worker 2, back,
    rejoins, heals from a live peer, and every later round is checked bit-identical across the
    three (`sync.check_replicas`); the job ends with all three and exits 0."""
    run_dir = tmp_path / "run"
    cut_s, grace_s, heartbeat_s = 6.0, 1.0, 1.0
    proc, left = cli(
        three_paced_workers_under_ft(
            200,
            run_dir,
            f"ft.grace_s={grace_s}",
            f"ft.heartbeat_timeout_s={heartbeat_s}",
            "ft.join_timeout_s=30",
            "sync.check_replicas=true",
        ),
        fault=f"partition:2:40:{cut_s}",
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    assert "ft: worker 2 stopped heartbeating (no progress for" in proc.stderr, proc.stderr[-3000:]
    assert "ft: worker 2 heartbeats again" in proc.stderr
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    seen = [(r["step"], r["wall_time_s"], r["participants"]) for r in lines if "participants" in r]
    pairs = [p for _, _, p in seen]
    assert [p for i, p in enumerate(pairs) if i == 0 or pairs[i - 1] != p] == [3, 2, 3], seen
    # worker 0 from its line at step 40 to the first line of the pair: the failed round's window
    # and the heartbeat timeout, not the partition
    at = {step: t for step, t, _ in seen}
    pair_at = next(t for step, t, p in seen if p == 2)
    assert pair_at - at[40] < grace_s + heartbeat_s + 1.5 < cut_s, seen
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["participants"] == 3
    assert summary["participants_min"] == 2 and summary["heals"] >= 1
    assert summary["replica_checks"] > 0  # every round checked, the healed worker's too

"""Asynchronous rounds under `ft=torchft` (docs/asynchronous.md#under-fttorchft): the syncer in the
launcher, every worker a process of its own that dies, restarts and rejoins.

With one worker the run equals the plain path's bit for bit (the syncer built from what the
first worker sends: the wire's codec, error feedback, Delayed Nesterov and HeLoCo's settings).
Under faults the job finishes: a killed worker is restarted and rejoins, a severed session
fails on both ends and the worker rejoins at once, a partition holds nobody but the partitioned
worker, and a worker frozen at the end is not waited for beyond one grace window; every worker
at the last meeting leaves it with the same model.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import faults
from tests.helpers import FAST, cli, listening, same_model

pytest.importorskip("torchft")

ONE = FAST + [  # one worker, DiLoCo on the int8 wire, Delayed Nesterov (N = 2), HeLoCo
    "dist.world_size=1", "trainer.max_steps=40", "trainer.batch_size=16", "sync=diloco",
    "sync.period=4", "sync.warmup_steps=0", "optim=adamw", "optim.lr=0.003",
    "sync.comm_dtype=int8", "sync.error_feedback=true", "sync.outer_delay=2",
    "sync.staleness_correction=heloco", "sync.mode=async", "trainer.checkpoint_every=0",
    "logger=jsonl", "sync.check_replicas=true",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments", [1, 2])
def test_one_worker_under_ft_equals_the_plain_path(tmp_path, fragments):
    """The hosted syncer is built from the json the first worker sends (`rejoin.spec`): it
    fails without any of the wire, the delay, the correction or the fragments carried over."""
    runs = {}
    for name, extra in (("plain", []), ("ft", ["ft=torchft"])):
        run_dir = tmp_path / name
        extra = [*extra, f"sync.fragments={fragments}"]
        proc, left = cli(ONE + extra + [f"hydra.run.dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not left
        runs[name] = json.loads((run_dir / "summary.json").read_text())
    assert same_model(tmp_path / "plain" / "model.pt", tmp_path / "ft" / "model.pt")
    # after the first step, then every 4, and the last meeting: 11 merges (of each fragment:
    # one every 2 steps, the meeting's of both)
    assert runs["ft"]["async_merges"] == runs["plain"]["async_merges"] == 11 * fragments
    assert runs["ft"]["async_corrected_blocks"] == runs["plain"]["async_corrected_blocks"]
    assert runs["ft"]["merged_samples"] == 40 * 16
    assert runs["ft"]["replica_checks"] == 1  # against the syncer's model, at the last meeting


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_stop_at_a_meeting_resumes_to_the_model_of_a_run_never_stopped(tmp_path):
    """Meetings every 10 steps: SIGTERM at step 11 stops the run at the meeting of step 20,
    with a checkpoint that holds the syncer's state (sent to the worker that writes it: Delayed
    Nesterov's buffers, HeLoCo's, the version); the same command resumes, the syncer built
    from that state, and ends on the model of a run never stopped, bit for bit (the outer
    momentum started afresh would not)."""
    args = [a for a in ONE if not a.startswith("trainer.checkpoint_every=")]
    args += ["ft=torchft", "trainer.checkpoint_every=10"]
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    proc, _ = cli(args + [f"hydra.run.dir={reference}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, left = cli(args + [f"hydra.run.dir={run_dir}", faults.override("sigterm:0:11")])
    assert proc.returncode == 143 and not left, proc.stderr[-3000:]
    assert "stopping after the next meeting" in proc.stderr
    assert "stopped after step 20 with a checkpoint" in proc.stderr, proc.stderr[-3000:]
    proc, _ = cli(args + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0 and "step-20" in proc.stderr, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", reference / "model.pt")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_checks"] == 2  # the resumed run's meetings: steps 30 and 40


FAULTS = FAST + [  # three workers, every step padded to 30 ms, a sync every 8 steps
    "dist.world_size=3", "trainer.max_steps=160", "trainer.batch_size=16", "sync=diloco",
    "sync.period=8", "sync.warmup_steps=0", "optim=adamw", "optim.lr=0.003",
    "comm.simulate.worker_speed=[1,1,1]", "comm.simulate.step_s=0.03", "sync.mode=async",
    "ft=torchft", "ft.grace_min_s=1", "trainer.checkpoint_every=50", "logger=jsonl",
    "sync.check_replicas=true", "sync.grace_s=0",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kills_severed_sessions_partitions_and_a_frozen_straggler(tmp_path):
    run_dir, digests = tmp_path / "run", tmp_path / "digests"
    args = [*FAULTS, f"hydra.run.dir={run_dir}"]
    for spec in (
        f"kill:1:20:{tmp_path / 'killed-once'}",  # restarted, rejoins from its last contribution
        "sever:0:50",  # its payload never arrives: both ends drop the session, it rejoins
        "partition:2:40:1.0",  # its exchange held 1 s: nobody else waits for it
        "freeze:2:144:5",  # frozen 5 s at its last exchanges: the run ends without it
    ):
        args = faults.with_fault(args, spec)
    args[-1] = args[-1][:-1] + f",{{_target_:tests.faults.FinalDigest,dir:'{digests}'}}]"
    proc, left = cli(args, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    assert "ft: worker 1 died (signal 9); restart 1 of 3, it catches up from the syncer" in (
        proc.stderr
    )
    # killed at step 20, it goes on after its contribution of step 16 (of step 8 where the
    # kill beat the syncer to reading that one), not from the start nor from where it died
    resumed = [line for line in proc.stderr.splitlines() if "rejoined the syncer" in line]
    assert len(resumed) == 1, resumed
    assert resumed[0].split("from step ")[1].split(",")[0] in ("17", "9"), resumed
    summary = json.loads((run_dir / "summary.json").read_text())
    # sessions per worker: the killed one's and the severed one's second, the others' one
    assert summary["async_sessions"] == [2, 2, 1], summary["async_sessions"]
    assert summary["async_failed_sessions"] >= 1 and summary["async_rejoins"] == 1
    assert summary["async_writer"] == 0 and summary["steps"] == 160
    # the writer's model against the syncer's, at each meeting: steps 50, 100, 150, 160
    assert summary["replica_checks"] == 4
    # worker 2's last phase (and whatever the killed worker redid too late) is not merged
    assert 0 < summary["merged_samples"] < 3 * 160 * 16
    written = {p.name: p.read_text() for p in digests.iterdir()}
    assert "rank-2.txt" not in written, "the run waited for the frozen worker"
    assert "rank-0.txt" in written and len(set(written.values())) == 1, written
    assert "the syncer failed" not in proc.stderr
    # checkpoints at the meetings (the newest two kept): 150's without the frozen worker
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-150", "step-160"]
    # no grace window on the wall clock: said once
    assert proc.stderr.count("sync.grace_s=0: every contribution is merged alone") == 1


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_every_worker_stops_at_the_meeting_a_stop_was_asked_at_and_resumes(tmp_path):
    """Two workers, meetings every 20 steps: the launcher's SIGTERM reaches both, the first
    meeting after it (step 40) agrees the stop for everyone there, the writer checkpoints with
    the syncer's state, every process exits, and the same command finishes the run."""
    run_dir = tmp_path / "run"
    args = [a for a in FAULTS if not a.startswith(("dist.world_size", "trainer.max_steps",
            "comm.simulate.worker_speed", "trainer.checkpoint_every"))]  # fmt: skip
    args += ["dist.world_size=2", "trainer.max_steps=80", "comm.simulate.worker_speed=[1,1]",
             "trainer.checkpoint_every=20", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, left = cli([*args, faults.override("sigterm:1:25")], timeout=120)
    assert proc.returncode == 143 and not left, proc.stderr[-3000:]
    assert "stopped after step 40 with a checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-20", "step-40"]
    proc, left = cli(args, timeout=120)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["replica_checks"] == 2  # meetings 60, 80


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_run_stopped_with_two_workers_resumes_with_three(tmp_path):
    """The checkpoint of an agreed stop holds the syncer's state and the meeting's model: the
    run resumes with another world size, the syncer going on from its version, the new worker
    starting from the meeting's model, and every worker leaving the last meeting on one model."""
    run_dir, digests = tmp_path / "run", tmp_path / "digests"
    args = [a for a in FAULTS if not a.startswith(("dist.world_size", "trainer.max_steps",
            "comm.simulate.worker_speed", "trainer.checkpoint_every"))]  # fmt: skip
    args += ["trainer.max_steps=80", "trainer.checkpoint_every=20", f"hydra.run.dir={run_dir}"]
    two = [*args, "dist.world_size=2", "comm.simulate.worker_speed=[1,1]"]
    proc, left = cli([*two, faults.override("sigterm:1:25")], timeout=120)
    assert proc.returncode == 143 and not left, proc.stderr[-3000:]
    assert "stopped after step 40 with a checkpoint" in proc.stderr, proc.stderr[-3000:]
    digest = f"trainer.callbacks=[{{_target_:tests.faults.FinalDigest,dir:'{digests}'}}]"
    three = [*args, "dist.world_size=3", "comm.simulate.worker_speed=[1,1,1]", digest]
    proc, left = cli(three, timeout=120)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert "step-40" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["replica_checks"] == 2  # meetings 60, 80
    assert len(summary["async_sessions"]) == 3, summary["async_sessions"]
    written = {p.name: p.read_text() for p in digests.iterdir()}
    assert sorted(written) == ["rank-0.txt", "rank-1.txt", "rank-2.txt"], written
    assert len(set(written.values())) == 1, written


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_hosted_syncer_leaves_out_contributions_older_than_max_staleness(tmp_path):
    """The launcher's syncer is built from the first worker's spec: `sync.max_staleness=0`
    reaches it, and a worker 10x slower by steps, whose every contribution is merges old, has
    none of them merged (a missing key would merge them all). (10x, not 3x: on the wall clock
    under load a 3x worker's contribution was once fresh, the fast one's steps slowed.)"""
    run_dir = tmp_path / "run"
    args = [a for a in FAULTS if not a.startswith(("dist.world_size", "trainer.max_steps",
            "comm.simulate.worker_speed", "trainer.checkpoint_every"))]  # fmt: skip
    args += ["dist.world_size=2", "trainer.max_steps=48", "comm.simulate.worker_speed=[1,10]",
             "trainer.checkpoint_every=0", "sync.max_staleness=0", "comm.simulate.step_s=0.01",
             f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, left = cli(args, timeout=100)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    dropped = summary["async_dropped_stale"]
    assert dropped and {worker for worker, *_ in dropped} == {1}, dropped
    assert summary["async_max_staleness"] == 0


@pytest.mark.slow
@pytest.mark.long  # ~8 s: `make test-long`
@pytest.mark.timeout(120)
def test_the_hosted_syncer_decides_an_adaptive_period_and_the_workers_follow(tmp_path):
    """`sync.schedule=adaptive` reaches the launcher's syncer in the first worker's spec: it
    decides the period (`fleet_period`) and every answer carries it, so the workers end on the
    syncer's period (a missing key: no decision, no `async_period`)."""
    run_dir = tmp_path / "run"
    args = [a for a in FAULTS if not a.startswith(("dist.world_size", "trainer.max_steps",
            "comm.simulate.worker_speed", "comm.simulate.step_s", "trainer.checkpoint_every",
            "sync.period="))]  # fmt: skip
    args += ["dist.world_size=2", "trainer.max_steps=60", "comm.simulate.worker_speed=[1,1]",
             "trainer.checkpoint_every=0", "comm.simulate.step_s=0.005", "sync.period=2",
             "sync.schedule=adaptive", "sync.adaptive_tolerance=0.0", "sync.max_period=16",
             f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, left = cli(args, timeout=100)
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["async_period_decisions"] >= 3
    assert summary["period"] == summary["async_period"] > 2


def test_a_merge_waits_only_for_workers_due_within_its_window():
    """On the wall clock a merge waits for a worker only where its next contribution is due
    within the window around the merge's oldest one (its last arrival plus its last interval):
    a worker in step is waited for, one out of step (back from a fault) or overdue (frozen)
    is not; without a history, and under the modelled clock, every worker is."""

    from localsgd.averaging.asynchronous.pacing import Pacing

    pacing = Pacing(grace_s=0.25, modelled=False)
    pacing.arrivals = {
        0: (8.0, 4.0),  # due at 12.0: in step
        1: (9.6, 4.0),  # due at 13.6: out of step by 1.6 s
        2: (4.0, 4.0),  # due at 8.0: overdue (frozen since)
        3: (11.9, None),  # one arrival only
    }
    assert [pacing.due(r, oldest=12.1) for r in range(5)] == [True, False, False, True, True]
    pacing.modelled = True
    assert all(pacing.due(r, oldest=12.1) for r in range(5))
    # an arrival records the interval since the last one
    pacing = Pacing(grace_s=0.25, modelled=False)
    pacing.arrived(0, 4.0)
    pacing.arrived(0, 8.0)
    assert pacing.arrivals[0] == (8.0, 4.0)


def test_a_worker_out_of_step_is_told_when_the_others_merge_next():
    """With a grace window, a worker whose next contribution is not due with most of the
    others' (back from a fault) is told how long its next phase should last to be merged with
    theirs again: their next merge at least half a period away. In step, or with no window, or
    under the modelled clock: nothing."""

    from localsgd.averaging.asynchronous.pacing import Pacing

    pacing = Pacing(grace_s=0.25, modelled=False)
    pacing.arrivals = {0: (8.0, 4.0), 1: (8.05, 4.0), 2: (8.1, 4.0), 3: (10.5, 4.0)}
    live = lambda w: True  # noqa: E731
    # the others merge next at 12.0, 1.4 s away: worker 3 aims at the merge after, at 16.0
    assert pacing.align(3, at=10.6, live=live) == pytest.approx(5.4)
    # ... and a merge then waits for it: it is due with them
    assert pacing.arrivals[3] == pytest.approx((10.5, 5.5)) and pacing.aligned[3] == 4.0
    # its next arrival goes on at their interval
    pacing.arrived(3, 16.0)
    assert pacing.arrivals[3] == (16.0, 4.0)
    assert pacing.align(0, at=8.0, live=live) is None
    # a worker no longer live is not one of the others it aligns with
    assert pacing.align(3, at=16.1, live=lambda w: w == 3) is None
    pacing.grace_s = 0.0
    assert pacing.align(3, at=10.6, live=live) is None
    pacing.grace_s, pacing.modelled = 0.25, True
    assert pacing.align(3, at=10.6, live=live) is None


def test_a_frozen_phase_does_not_widen_the_adaptive_window():
    """On the wall clock a worker reports the median of its last 3 phases' mean steps: one
    phase with a 5-s freeze in it leaves the window at a step."""
    from localsgd.averaging.asynchronous.pacing import typical_step

    assert typical_step([]) is None
    assert typical_step([0.25]) == 0.25
    assert typical_step([0.25, 0.26, 5.25 / 16]) == 0.26
    assert typical_step([0.25, 0.25 + 5 / 16, 0.24]) == 0.25


def test_the_hosted_syncer_listens_on_its_host_only():
    """Its store serves the global model to whoever joins: it listens on `ft.host` alone
    (TCPStore by itself listens on every interface), through `localsgd.averaging.stores`."""
    from localsgd.averaging.asynchronous.links import Sessions
    from localsgd.averaging.stores import serving_store

    sessions = Sessions("127.0.0.1", timeout_s=5)
    assert listening(sessions.serving.port) == ["0100007F"]  # 127.0.0.1, not :: or 0.0.0.0
    served = serving_store("127.0.0.1")
    assert listening(served.port) == ["0100007F"]
    served.store.set("key", "value")  # a working store
    assert served.store.get("key") == b"value"


def test_a_serving_store_gone_closes_nobody_elses_socket():
    """The store owns its listening descriptor and closes it when it goes; the number is then
    reused by new sockets, and what is left of the serving store must not close it again (it
    did: a replica's store in another thread broke with EPIPE)."""
    import gc
    import socket

    from localsgd.averaging.stores import serving_store

    served = serving_store("127.0.0.1")
    served.store = None  # the store goes: its descriptors are free again
    gc.collect()
    pairs = [socket.socketpair() for _ in range(8)]  # the lowest free numbers: those
    del served
    gc.collect()
    for a, b in pairs:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
        a.close(), b.close()


class _FakeSessions:
    """`links.Sessions` without a network: each worker's mailbox puts, and the tensors sent."""

    sessions = True

    def __init__(self):
        self.put: list[tuple[int, str]] = []
        self.messages: dict[tuple[int, str], dict] = {}
        self.sent: list[int] = []
        self.open: set[int] = set()

    def accept(self, request):
        self.open.add(request["worker"])

    def drop(self, worker):
        self.open.discard(worker)

    def connected(self, worker):
        return worker in self.open

    def box(self, r):
        def put(key, message):
            self.put.append((r, key))
            self.messages[r, key] = message

        return SimpleNamespace(put=put)

    def send(self, r, tensor, tag):
        self.sent.append(r)


def _hosted(size: int):
    import torch

    from localsgd.averaging.asynchronous.hosted import HostedService

    links = _FakeSessions()
    service = HostedService(
        links, size, end_wait_s=1.0, modelled=False, min_quorum=1, grace_s=0.25,
        bootstrap=lambda request, recv: (
            SimpleNamespace(
                values=[torch.zeros(2)], versions=[0], values_of=lambda f: [torch.zeros(2)],
                period=None,
            ),
            None,
        ),
    )  # fmt: skip
    return service, links


def test_training_starts_once_every_worker_has_joined():
    """The hosted syncer sends nobody the global model (so nobody takes a first step) until
    every worker has joined once; one joining later (a restart) is welcomed at once."""
    service, links = _hosted(3)
    service._join({"worker": 1})  # the first brings the model the syncer starts from
    service._join({"worker": 0})
    service._join({"worker": 0})  # a reconnect: still held
    assert not service._advance() and links.sent == [] and not service.started
    service._join({"worker": 2})
    links.drop(1)  # its session failed meanwhile: it gets the model when it rejoins
    assert service._advance() and service.started
    assert links.sent == [0, 2]
    service._join({"worker": 1})
    assert links.sent == [0, 2, 1]


def test_the_start_does_not_wait_for_a_worker_the_launcher_gave_up_on():
    """A worker out of restarts before it ever joined: the others start without it, on the
    syncer's next turn (the launcher's `lose` rings no bell)."""
    service, links = _hosted(2)
    service._join({"worker": 0})
    assert not service._advance() and links.sent == []
    service.lose(1)
    assert service._advance() and links.sent == [0]


def test_a_worker_not_holding_the_syncers_model_fails_the_replica_check():
    """`sync.check_replicas` under ft=torchft: after each meeting each worker compares the
    model it holds with the checksum of the syncer's global model; one changed bit fails."""
    import torch

    from localsgd.averaging.checksum import replica_checksum
    from localsgd.loop.async_sessions import AsyncSessions
    from localsgd.loop.guards import ReplicasDiverged

    held = [torch.arange(6, dtype=torch.float32)]
    averager = SimpleNamespace(
        meetings=0, meeting={}, step=10, common_tensors=lambda: held, maybe_average=lambda: None
    )
    driver = AsyncSessions(averager, worker=1, seed=0, attempt=0, verify=True)
    driver.maybe_average()  # no meeting: nothing checked
    assert driver.replica_checks == 0
    averager.meetings, averager.meeting = 1, {"checksum": replica_checksum(held).tolist()}
    driver.maybe_average()
    driver.maybe_average()  # the same meeting is checked once
    assert driver.replica_checks == 1
    averager.meetings = 2
    held[0][3] = torch.nextafter(held[0][3], torch.tensor(10.0))
    with pytest.raises(ReplicasDiverged, match="worker 1 does not hold the syncer's global"):
        driver.maybe_average()


def test_a_state_dict_travels_as_json_and_tensors():
    """The syncer's state to the writer and back on a resume (`trees.tree_as_json`): an
    optimizer's int keys, tuples, numbers and None come back as they were, the tensors in
    order with their dtypes; anything json cannot say is refused, not pickled."""
    import torch

    from localsgd.averaging.trees import tree_as_json, tree_from_json

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    state = {"optimizers": [optimizer.state_dict()], "version": 7, "dropped": [(1, 2.5)],
             "anchor": torch.arange(4, dtype=torch.bfloat16), "note": None}  # fmt: skip
    packed, tensors = tree_as_json(state)
    packed = json.loads(json.dumps(packed))  # what the mailbox carries
    sent = iter(tensors)
    back = tree_from_json(packed, lambda t: t.copy_(next(sent)))
    assert back["version"] == 7 and back["dropped"] == [(1, 2.5)] and back["note"] is None
    assert back["anchor"].dtype == torch.bfloat16 and torch.equal(back["anchor"], state["anchor"])
    again = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    again.load_state_dict(back["optimizers"][0])  # int keys: the momentum found its parameter
    assert torch.equal(again.state[again.param_groups[0]["params"][0]]["momentum_buffer"],
                       torch.ones(3))  # fmt: skip
    with pytest.raises(TypeError, match="a tree holding a object is not sent as json"):
        tree_as_json({"x": object()})


@pytest.mark.timeout(20)
def test_a_dropped_session_ends_the_workers_wait_at_once():
    """A worker frozen past a transfer's deadline finds, when it wakes, its session dropped:
    it waits for an answer that never comes until the syncer marks the session closed, and
    then fails at once (and rejoins), not after its own deadline (dist.timeout_s)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from localsgd.averaging.asynchronous.links import LINK_ERRORS, Sessions, WorkerLink
    from localsgd.averaging.asynchronous.mailbox import Mailbox

    sessions = Sessions("127.0.0.1", timeout_s=5)
    # a session as `accept` leaves it (its process group is not needed: nothing is sent here)
    sessions.open[0] = ("s0", Mailbox(sessions.store, "s/s0/", 5), None)
    host, port = sessions.address.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    link = WorkerLink(Mailbox(client, "s/s0/", 30), None, 0, 30, session=True)
    threading.Timer(0.3, sessions.drop, args=(0,)).start()
    start = time.monotonic()
    with pytest.raises(LINK_ERRORS, match="the syncer dropped this session"):
        link.mailbox.take("r/0/0", link.alive)
    assert time.monotonic() - start < 5


def _meeting(step: int, seq: int, stop: bool = False) -> dict:
    return {"kind": "meet", "step": step, "seq": seq, "stop": stop, "last": False,
            "versions": [0], "fragments": [0], "weights": [0], "samples": 0,
            "at": 1.0}  # fmt: skip


def test_a_worker_late_to_a_meeting_meets_alone_and_neither_writes_nor_stops_the_run():
    """A meeting is held without a worker behind once its deadline passes, the first worker
    there writing the checkpoint. The one behind, at that step later, meets alone: it writes
    nothing, a stop it asks for waits for the next meeting that checkpoints, and the meeting
    the others wait at keeps its deadline."""
    import time

    from localsgd.averaging.asynchronous.hosted import HostedService, build_syncer

    spec = {
        "buffers": [[4, "float32"]], "parts": [[[0, 0, 4, 4]]], "blocks": [[0, 0, 4]],
        "sgd": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "warmup_rounds": 0},
        "plain_first": False, "wire": {"dtype": "float32"}, "aggregate": None,
        "correction": None, "normalized": True,
    }  # fmt: skip
    links = _FakeSessions()
    service = HostedService(
        links, 2, end_wait_s=60.0, modelled=False, min_quorum=1, grace_s=0.0,
        bootstrap=lambda request, recv: build_syncer({"spec": spec}, lambda t: t.zero_()),
    )  # fmt: skip
    service._join({"worker": 0})
    service._join({"worker": 1})
    assert service._advance() and service.started
    service.met[0] = _meeting(step=9, seq=0)
    assert not service._meet_without([0, 1])  # waits for worker 1
    service.meeting_deadline = time.monotonic() - 1  # ... until its deadline passed
    assert service._meet_without([0, 1])
    assert links.messages[0, "r/0/0"]["writer"] == 0  # it writes the checkpoint of step 10
    service.met[0] = _meeting(step=19, seq=1)  # at the next meeting: waiting for worker 1
    assert not service._meet_without([0, 1])
    deadline = service.meeting_deadline
    service.met[1] = _meeting(step=9, seq=0, stop=True)  # worker 1, late, signalled
    assert service._meet_without([0, 1])
    late = links.messages[1, "r/1/0"]
    assert late["writer"] is None and late["stop"] is False and late["state"] is None
    assert service.meeting_deadline == deadline and not service.ended
    assert service.met[0] is not None  # still waiting at the meeting of step 20

"""How local workers start: forked from one server that imported torch once, with the
launcher's environment as it is at each launch, and never outliving their launcher; the server
forked from the launcher only on the CPython it was tested on, multiprocessing's own elsewhere."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from unittest import mock

import pytest

from localsgd.cli import forkserver
from localsgd.loop import checkpoint
from tests import helpers
from tests.helpers import BASE, ROOT, run_distributed, survivors, tagged_env

pytestmark = pytest.mark.slow


def _origin(rank: int, world_size: int) -> tuple[int, str | None, bool]:
    # nothing this test's module imports loads torch._dynamo: only a preloaded server has it
    return os.getppid(), os.environ.get("LOCALSGD_PROBE"), "torch._dynamo" in sys.modules


def _sleep(info, store) -> None:
    time.sleep(100)  # no collective, no store: nothing but the launcher watch can end it


def _all_gone(tag: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while survivors(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not survivors(tag)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(") ")[-1].split()[1])


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


@pytest.mark.timeout(120)
def test_workers_fork_from_one_preloaded_server_with_the_environment_of_now(monkeypatch):
    run_distributed(_origin, 2)  # the server runs from here on
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    # a variable set after the server started still reaches the workers
    monkeypatch.setenv("LOCALSGD_PROBE", "set after the server started")
    assert run_distributed(_origin, 2) == [(server, "set after the server started", True)] * 2


@pytest.mark.timeout(120)
def test_the_cli_forks_its_workers_server_and_a_sigkilled_launcher_takes_all_with_it(tmp_path):
    """SIGKILL runs no handler in the launcher: the workers' watch on its pipe must end them,
    and the kernel's parent-death signal the server forked from it."""
    run_dir = tmp_path / "run"
    env, tag = tagged_env()
    args = [*BASE, "trainer.max_steps=100000", f"hydra.run.dir={run_dir}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "localsgd.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        while not checkpoint.newest_complete(str(run_dir), 2):  # the workers are training
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # the workers' server is the launcher forked once its imports were done
        parent = {pid: _ppid(pid) for pid in survivors(tag) if pid != launcher.pid}
        (server,) = {parent[pid] for pid in parent if parent[pid] != launcher.pid}
        assert parent[server] == launcher.pid
        assert _cmdline(server).startswith(
            f"localsgd forkserver (launcher {launcher.pid}, forked)".encode()
        )
        assert sum(ppid == server for ppid in parent.values()) == 2  # the two workers
    finally:
        launcher.kill()
        launcher.wait()
    assert _all_gone(tag, within_s=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind",
    # all in `make test-long`: the sigkilled launcher above takes its workers with it
    [pytest.param(k, marks=pytest.mark.long) for k in forkserver.KINDS],
)
def test_workers_that_touch_no_peer_still_die_with_a_sigkilled_launcher(kind):
    env, tag = tagged_env({forkserver.ENV: kind})
    harness = "from localsgd.cli.launch import spawn; from tests.test_launch import _sleep; "
    launcher = subprocess.Popen(
        [sys.executable, "-c", harness + "spawn(_sleep, 2, 60)"], cwd=ROOT, env=env
    )
    try:
        deadline = time.monotonic() + 40
        while sum(_ppid(pid) != launcher.pid for pid in survivors(tag)) < 2:  # the two workers
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait()
    assert _all_gone(tag, within_s=5)


@pytest.mark.timeout(120)
def test_the_harness_sees_every_process_of_a_command_it_forks(tmp_path):
    """tests/helpers.py's `cli` forks commands from the session's forkserver, where /proc shows
    no tagged environment: the tag is in the process name, or every test's check that no
    process outlived its job would pass vacuously."""
    tags = []

    def tagging(extra=None):
        env, tag = tagged_env(extra)
        tags.append(tag)
        return env, tag

    job = [*BASE, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'run'}"]
    with mock.patch.object(helpers, "tagged_env", tagging):
        runner = threading.Thread(target=helpers.cli, args=(job,), kwargs={"timeout": 100})
        runner.start()
    running = []
    try:
        deadline = time.monotonic() + 60
        while not checkpoint.newest_complete(str(tmp_path / "run"), 2):
            assert runner.is_alive() and time.monotonic() < deadline
            time.sleep(0.1)
        running = survivors(tags[0])
        assert len(running) >= 4  # the command, its workers' server, two workers
    finally:
        for pid in running:
            os.kill(pid, signal.SIGKILL)
        runner.join()


def _authenticated_main(
    listener_fd, alive_r, preload, main_path=None, sys_path=None, *, authkey_r=None
):
    pass  # multiprocessing.forkserver.main as CPython 3.14 declares it


@pytest.mark.timeout(10)
def test_the_forked_server_runs_only_on_a_tested_cpython_whose_server_skips_no_authentication(
    monkeypatch,
):
    monkeypatch.delenv(forkserver.ENV, raising=False)
    assert (3, 11) in forkserver.TESTED_PYTHONS  # what the suite runs on
    here = (
        sys.implementation.name == "cpython" and sys.version_info[:2] in forkserver.TESTED_PYTHONS
    )
    assert forkserver.server_kind() == ("forked" if here else "public")
    monkeypatch.setenv(forkserver.ENV, "public")
    assert forkserver.server_kind() == "public"
    monkeypatch.setenv(forkserver.ENV, "fork")
    with pytest.raises(ValueError, match="forked, public"):
        forkserver.server_kind()
    monkeypatch.setenv(forkserver.ENV, "forked")
    server = multiprocessing.forkserver._forkserver
    elsewhere = [
        (sys, "version_info", (3, 10, 14, "final", 0)),
        (sys, "version_info", (3, 12, 8, "final", 0)),
        (sys, "version_info", (3, 13, 5, "final", 0)),  # its forkserver authenticates
        (sys, "version_info", (3, 14, 0, "final", 0)),
        (sys, "implementation", SimpleNamespace(name="pypy")),
        # a 3.11 release whose server authenticated its clients (a backport) keeps that
        (multiprocessing.forkserver, "_AUTHKEY_LEN", 32),
        (multiprocessing.forkserver, "main", _authenticated_main),
    ]
    for where, name, value in elsewhere:
        with monkeypatch.context() as m:
            m.setattr(where, name, value, raising=False)
            assert forkserver.server_kind() == "public", (name, value)
    for field in ("_forkserver_alive_fd", "_lock"):
        with monkeypatch.context() as m:
            m.delattr(server, field)
            assert forkserver.server_kind() == "public", field


def _launch_outside_the_tested_set() -> None:
    """Workers from a launcher that the gate takes for CPython 3.14 (after the imports: only the
    gate reads the version), which would fork its server if the gate let it."""
    sys.version_info = (3, 14, 0, "final", 0)
    kind = forkserver.server_kind()
    os.environ["LOCALSGD_PROBE"] = "set before the launch"
    origins = run_distributed(_origin, 2)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    found = {"kind": kind, "origins": origins, "server": server, "launcher": os.getpid()}
    found.update(parent=_ppid(server), cmdline=_cmdline(server).decode(errors="replace"))
    print(json.dumps(found))


@pytest.mark.long  # make test-long: every CLI test forks from the preloaded server
@pytest.mark.timeout(90)
def test_outside_the_tested_set_multiprocessing_starts_the_preloaded_server():
    env, tag = tagged_env({forkserver.ENV: None})
    harness = "from tests.test_launch import _launch_outside_the_tested_set as f; f()"
    launcher = subprocess.run(
        [sys.executable, "-c", harness],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert launcher.returncode == 0, launcher.stderr[-3000:]
    found = json.loads(launcher.stdout.strip().splitlines()[-1])
    assert found["kind"] == "public"
    # a fresh interpreter started by multiprocessing (not a fork of the launcher), which
    # preloaded torch._dynamo for the workers forked from it; it names itself so in `ps`
    launcher = found["launcher"]
    assert found["cmdline"].startswith(
        f"localsgd forkserver (launcher {launcher}, fresh interpreter)"
    )
    assert found["parent"] == found["launcher"]
    expected = [found["server"], "set before the launch", True]
    assert found["origins"] == [expected, expected]
    assert _all_gone(tag, within_s=10)


def test_a_fault_joins_the_callbacks_a_command_already_lists():
    """`cli(args, fault=...)` adds its Fault to a `trainer.callbacks=[...]` already in `args`
    (an attack): a second `trainer.callbacks=` override would replace the first, and a test
    would kill a run that, unseen, had no attacker."""
    from tests.faults import with_fault
    from tests.helpers import compose_config

    attack = "trainer.callbacks=[{_target_:localsgd.loop.attacks.Attack,kind:nan,rank:1}]"
    args = with_fault(["sync.period=4", attack], "kill:1:9")
    targets = [c["_target_"] for c in compose_config(args).trainer.callbacks]
    assert targets == ["localsgd.loop.attacks.Attack", "tests.faults.Fault"]
    alone = compose_config(with_fault(["trainer.callbacks=[]"], "kill:1:9")).trainer.callbacks
    assert [c["_target_"] for c in alone] == ["tests.faults.Fault"]
    assert with_fault(["sync.period=4"], "raise:0:3")[-1].startswith("trainer.callbacks=[")


def _loopback_only(info, store) -> None:
    found = helpers.listening(store.port)
    if found != ["0100007F"]:  # 127.0.0.1
        raise AssertionError(f"the rendezvous store listens on {found}")


@pytest.mark.timeout(60)
def test_the_rendezvous_store_listens_on_the_loopback_only():
    """The launcher's store carries the workers' rendezvous and stop signal: a TCPStore of its
    own would listen on every interface (`localsgd.averaging.stores`)."""
    from localsgd.cli.launch import spawn

    assert spawn(_loopback_only, 1, 30) is None


_TEARDOWN_PROBE = """
import atexit, sys
import localsgd.cli.train
from localsgd import train

def cli():
    atexit.register(lambda: print("interpreter teardown ran", flush=True))
    print("trained", flush=True)
    sys.exit({code!r})

localsgd.cli.train.cli = cli
train.main()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code, status", [(None, 0), (3, 3), ("failed: one line", 1)])
def test_a_torchrun_worker_leaves_without_interpreter_teardown_with_its_exit_status(code, status):
    # Interpreter teardown destroys gloo's and torchft's native threads, which has aborted a
    # finished worker (SIGABRT), and torchrun fails the job for it: a torchrun worker leaves as a
    # spawned one does, by os._exit, with the status sys.exit would have given.
    probe = _TEARDOWN_PROBE.format(code=code)
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
    plain_env = {k: v for k, v in os.environ.items() if k not in torchrun_env}
    for env, torn_down in ((plain_env, True), ({**plain_env, **torchrun_env}, False)):
        proc = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=50,
        )  # fmt: skip
        assert proc.returncode == status, proc.stderr[-2000:]
        assert "trained" in proc.stdout
        assert ("interpreter teardown ran" in proc.stdout) is torn_down, proc.stdout
        if isinstance(code, str):
            assert code in proc.stderr

"""How local workers start: forked from one server that imported torch once, with the
launcher's environment as it is at each launch, and never outliving their launcher."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import subprocess
import sys
import time

import pytest

from localsgd.cli import forkserver
from localsgd.loop import checkpoint
from tests.helpers import BASE, ROOT, run_distributed, survivors, tagged_env

pytestmark = pytest.mark.slow


def _origin(rank: int, world_size: int) -> tuple[int, str | None]:
    return os.getppid(), os.environ.get("LOCALSGD_PROBE")


@pytest.mark.timeout(120)
def test_workers_fork_from_one_preloaded_server_with_the_environment_of_now(monkeypatch):
    run_distributed(_origin, 2)  # the server runs from here on
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline") as f:
        command = f.read()
    assert all(repr(module) in command for module in forkserver.PRELOAD), command
    # a variable set after the server started still reaches the workers
    monkeypatch.setenv("LOCALSGD_PROBE", "set after the server started")
    assert run_distributed(_origin, 2) == [(server, "set after the server started")] * 2


@pytest.mark.timeout(120)
def test_a_sigkilled_launcher_takes_its_workers_and_forkserver_with_it(tmp_path):
    """SIGKILL runs no handler in the launcher: only the kernel's death signal, through the
    forkserver the workers were forked from, can end them."""
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
        assert len(survivors(tag)) >= 4  # launcher, forkserver, two workers
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while survivors(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not survivors(tag)

"""Ctrl-C as a terminal sends it (SIGINT to the whole process group): the first stops at an
agreed step with a checkpoint, like SIGTERM; the second aborts at once. Neither prints a
traceback, and no process is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import FAST, ROOT, cli

pytestmark = pytest.mark.slow

LONG = FAST + [
    "dist.world_size=2",
    "trainer.max_steps=100000",
    "trainer.log_every=5",
    "trainer.checkpoint_every=100000",
    "sync.period=8",
]


def _start(run_dir, *extra: str) -> subprocess.Popen:
    # A job started from a non-interactive shell inherits SIGINT ignored: reset it, as a terminal
    # would have it, in a session of its own so that the signal reaches the group alone.
    return subprocess.Popen(
        [sys.executable, "-m", "localsgd.train", *LONG, *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_training(proc, run_dir, timeout_s: float = 90) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)


def _group_gone(pgid: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(180)
def test_first_ctrl_c_stops_at_a_sync_with_a_checkpoint_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_training(proc, run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "Ctrl-C: stopping at the next sync with a checkpoint" in err
    stopped = int(re.search(r"stopped after step (\d+) with a checkpoint", err).group(1))
    assert stopped % 8 == 1  # right after a sync (steps counted from 1; averages after s % 8 == 0)
    assert (run_dir / "checkpoints" / f"step-{stopped}").is_dir()
    assert not (run_dir / "summary.json").exists()
    assert _group_gone(proc.pid)
    # ... and resumes: the same command, one step longer, continues from that checkpoint
    again = [a for a in LONG if not a.startswith("trainer.max_steps=")]
    again += [f"trainer.max_steps={stopped + 1}", f"hydra.run.dir={run_dir}"]
    resumed, left = cli(again)
    assert resumed.returncode == 0 and not left, resumed.stderr[-2000:]
    assert re.search(rf"resuming from \S*step-{stopped}\b", resumed.stderr), resumed.stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == stopped + 1


@pytest.mark.timeout(180)
def test_second_ctrl_c_aborts_at_once_without_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "sync.period=50000")  # no sync ahead: the first Ctrl-C cannot finish
    _wait_for_training(proc, run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # still training towards a sync that is far away
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Ctrl-C: aborted" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert _group_gone(proc.pid)

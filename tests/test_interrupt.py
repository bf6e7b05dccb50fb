"""Ctrl-C as a terminal sends it (SIGINT to the whole process group): the first stops at an
agreed step with a checkpoint, like SIGTERM; the second aborts at once. Neither prints a
traceback, and no process is left behind. SIGTERM to the whole group, as SLURM and Kubernetes
send it at pre-emption, stops with a checkpoint too. A stopped run exits 130 (Ctrl-C) or 143
(SIGTERM), never 0: it has not finished."""

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
    assert proc.returncode == 130, err[-2000:]  # stopped with a checkpoint, not finished
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "Ctrl-C: stopping at the next sync with a checkpoint" in err
    # the workers got it forwarded as SIGTERM; their line names what the user did
    stopped = int(re.search(r"Ctrl-C: stopped after step (\d+) with a checkpoint", err).group(1))
    assert "SIGTERM: stopped" not in err
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


@pytest.mark.long  # make test-long: the first Ctrl-C's stop and resume stays in make test
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


def _processes(pgid: int) -> dict[int, tuple[int, str]]:
    """pid: (parent pid, command line), of every live process in the group."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(pid)] = (int(fields[1]), cmdline)
    return found


@pytest.mark.timeout(180)
def test_sigterm_to_every_process_of_the_job_stops_with_a_checkpoint_and_resumes(tmp_path):
    """SLURM and Kubernetes signal every process of a job: the workers' forkserver must outlive
    it while the workers agree on a stop and checkpoint, and the command must exit as stopped."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_training(proc, run_dir)
    titles = sorted(t for _, t in _processes(proc.pid).values())
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "died" not in err, err[-2000:]
    stopped = int(re.search(r"stopped after step (\d+) with a checkpoint", err).group(1))
    assert (run_dir / "checkpoints" / f"step-{stopped}").is_dir()
    assert not (run_dir / "summary.json").exists()
    assert _group_gone(proc.pid)
    # every process says what it is in `ps` (its command line)
    launcher = [t for t in titles if t.startswith("localsgd launcher: ")]
    assert len(launcher) == 1 and f"hydra.run.dir={run_dir}" in launcher[0], titles
    assert sum(t.startswith("localsgd forkserver (launcher ") for t in titles) == 1, titles
    for rank in (0, 1):
        assert sum(t.startswith(f"localsgd worker {rank}/2 (launcher ") for t in titles) == 1
    # the same command resumes from that checkpoint (one step longer, so that it finishes)
    again = [a for a in LONG if not a.startswith("trainer.max_steps=")]
    again += [f"trainer.max_steps={stopped + 1}", f"hydra.run.dir={run_dir}"]
    resumed, left = cli(again)
    assert resumed.returncode == 0 and not left, resumed.stderr[-2000:]
    assert re.search(rf"resuming from \S*step-{stopped}\b", resumed.stderr), resumed.stderr[-2000:]


@pytest.mark.long  # make test-long: a rare failure of the harness itself
@pytest.mark.timeout(120)
def test_a_killed_forkserver_is_named_in_one_line_and_the_workers_are_stopped(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_training(proc, run_dir)
    group = _processes(proc.pid)
    (server,) = {parent for parent, _ in group.values() if parent in group and parent != proc.pid}
    began = time.monotonic()
    os.kill(server, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - began < 10  # at once, not after dist.timeout_s
    assert proc.returncode == 1, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: the workers' forkserver (pid {server}) died (killed by SIGKILL); the workers "
        f"were stopped, the last complete checkpoint is kept"
    ], err[-2000:]
    assert "Traceback" not in err and "exit code 255" not in err, err[-2000:]
    assert _group_gone(proc.pid, timeout_s=5)


@pytest.mark.long  # make test-long: the SIGTERM stop of async ft is in tests/test_async_ft.py
@pytest.mark.timeout(180)
def test_ctrl_c_stops_asynchronous_ft_rounds_at_the_next_meeting(tmp_path):
    """Asynchronous rounds under ft=torchft: the syncer lives in the launcher, and the stop is
    agreed at the next meeting (every 20 steps) with a checkpoint; Ctrl-C exits 130."""
    run_dir = tmp_path / "run"
    proc = _start(
        run_dir, "sync=diloco", "sync.mode=async", "sync.warmup_steps=0", "ft=torchft",
        "sync.grace_s=0.05", "trainer.checkpoint_every=20",
    )  # fmt: skip
    _wait_for_training(proc, run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stopped = int(re.search(r"stopped after step (\d+) with a checkpoint", err).group(1))
    assert stopped % 20 == 0 and (run_dir / "checkpoints" / f"step-{stopped}").is_dir(), err
    assert not (run_dir / "summary.json").exists()
    assert _group_gone(proc.pid)

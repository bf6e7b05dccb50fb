"""`trainer.resume=auto` under a timestamped `hydra.run.dir` (localsgd/cli/run_dir.py): the same
command continues the newest unfinished run of the same job; a finished run, another job's run or
a run in use is never continued; a SLURM requeue takes its own run; the printed resume command
parses back."""

from __future__ import annotations

import json
import os
import re
import shlex
import time

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from localsgd.cli import run_dir as run_dirs
from tests.helpers import FAST, cli, refusal

pytestmark = pytest.mark.timeout(60)

JOB = ["sync.period=4", "data=synthetic"]


def _run(root, name: str, overrides=JOB, finished=False, checkpoint=True, slurm=None):
    run_dir = root / "2026-12-06" / name
    run_dir.mkdir(parents=True)
    record = {"overrides": overrides}
    if slurm is not None:
        record["slurm"] = {"job_id": slurm, "array_task_id": ""}
    (run_dir / run_dirs.JOB_FILE).write_text(json.dumps(record))
    if finished:
        (run_dir / "summary.json").write_text("{}")
    if checkpoint:
        (run_dir / "ckpt").write_text("")
    time.sleep(0.01)  # mtimes in creation order
    return str(run_dir)


def _find(root):
    return run_dirs.find_run(str(root), 2, JOB, lambda d: os.path.exists(os.path.join(d, "ckpt")))


def test_the_newest_unfinished_run_of_the_same_job_is_continued(tmp_path):
    older = _run(tmp_path, "10-00-00")
    _run(tmp_path, "11-00-00", overrides=["sync.period=8", "data=synthetic"])  # another job
    _run(tmp_path, "12-00-00", finished=True)  # finished: never continued
    assert _find(tmp_path).run_dir == older
    newer = _run(tmp_path, "13-00-00")
    assert _find(tmp_path).run_dir == newer


def test_a_run_without_a_checkpoint_or_in_use_is_passed_over_with_a_line(tmp_path):
    _run(tmp_path, "10-00-00", checkpoint=False)
    found = _find(tmp_path)
    assert found.run_dir is None and "stopped before its first checkpoint" in found.line
    busy = _run(tmp_path, "11-00-00")
    run_dirs.hold(busy)
    try:
        found = _find(tmp_path)
        assert found.run_dir is None and f"is running (pid {os.getpid()})" in found.line
    finally:
        run_dirs.let_go(busy)
    assert _find(tmp_path).run_dir == busy


def test_a_slurm_requeue_takes_the_run_its_job_wrote(tmp_path, monkeypatch):
    mine = _run(tmp_path, "10-00-00", slurm="700")
    other = _run(tmp_path, "11-00-00", slurm="800")
    monkeypatch.setenv("SLURM_JOB_ID", "700")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert _find(tmp_path).run_dir == mine
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # a new job: the newest of the same job
    assert _find(tmp_path).run_dir == other


def test_the_job_is_its_overrides_less_where_and_whether_it_resumes():
    a = run_dirs.job_overrides(["b=1", "a=2", "hydra.run.dir=x", "trainer.resume=auto"], [])
    b = run_dirs.job_overrides(["a=2", "b=1", "hydra/launcher=submitit_local"], [])
    assert a == b == ["a=2", "b=1"]
    assert run_dirs.pattern_root("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}") == ("outputs", 2)
    assert run_dirs.pattern_root("/runs/a") is None


@pytest.mark.parametrize("path", ["/runs/a b/k=1", "/runs/it's,here", "/runs/plain-1"])
def test_the_printed_resume_command_parses_back_to_the_directory(path):
    line = run_dirs.resume_command(["sync.period=4", "hydra.run.dir=/old"], path)
    args = shlex.split(line)
    assert args[1:3] == ["-m", "localsgd.train"] and "hydra.run.dir=/old" not in args
    overrides = OverridesParser.create().parse_overrides(args[3:])
    assert overrides[-1].key_or_group == "hydra.run.dir" and overrides[-1].value() == path


def test_a_run_dir_in_use_by_a_running_job_is_refused(tmp_path, capsys):
    run_dirs.hold(str(tmp_path))
    try:
        line = refusal(FAST + [f"hydra.run.dir={tmp_path}"], capsys)
    finally:
        run_dirs.let_go(str(tmp_path))
    assert f"is in use by a running job (pid {os.getpid()})" in line


def test_two_commands_in_the_same_second_get_two_directories(tmp_path):
    first = run_dirs.new_run_dir(str(tmp_path / "t"))
    second = run_dirs.new_run_dir(str(tmp_path / "t"))
    assert first != second and os.path.isdir(second)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_same_command_continues_a_stopped_run_and_never_a_finished_one(tmp_path):
    args = FAST + [
        "dist.world_size=2",
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "sync.period=5",
        "hydra.run.dir=" + str(tmp_path / "outputs") + "/${now:%Y-%m-%d}/${now:%H-%M-%S}",
    ]
    stopped, _ = cli(args, fault="sigterm:0:13")
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    first = re.search(r"run dir: (\S+) \(interrupted", stopped.stdout)[1]
    again, _ = cli(args, fault="sigterm:0:13")  # the same command: it continues, and finishes
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"continuing {first}" in again.stderr and "resuming from" in again.stderr
    assert re.search(r"run dir: (\S+)\n", again.stdout)[1] == first
    third, _ = cli(args, fault="sigterm:0:13")  # the run finished: a new one
    assert third.returncode == 143 and "continuing" not in third.stderr, third.stderr[-2000:]
    new = re.search(r"run dir: (\S+) \(interrupted", third.stdout)[1]
    assert new != first and os.path.exists(os.path.join(first, "summary.json"))
    command = re.search(r"to resume .*?: (.+)", third.stdout)[1]
    assert shlex.split(command)[-1] == f"hydra.run.dir={new}"


def test_a_filesystem_without_locks_is_not_taken_for_a_run_in_use(tmp_path, monkeypatch):
    """flock on some NFS mounts fails with ENOLCK: that says nothing of a live job."""
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    (tmp_path / run_dirs.LOCK_FILE).write_text("123")
    assert run_dirs.in_use(str(tmp_path)) is None
    run_dirs.hold(str(tmp_path))
    run_dirs.let_go(str(tmp_path))


def test_under_torchft_only_the_first_replica_groups_rank_0_holds_a_shared_run_dir(monkeypatch):
    """Every replica group's torchrun may share one run directory: only the first group's rank
    0 holds it (the others' rank 0 were refused as "in use" by the first's lock)."""
    from localsgd.cli.forkserver import TORCHRUN_VARS
    from localsgd.cli.precheck import decides_run_dir
    from tests.helpers import compose_config

    assert decides_run_dir()  # the launcher of local workers
    for var in TORCHRUN_VARS:
        monkeypatch.setenv(var, "0")
    monkeypatch.setenv("RANK", "0")
    plain = compose_config([])
    assert decides_run_dir(plain)
    for replica_id, decides in (("group_0", True), ("group_1", False), ("machine_12", False)):
        cfg = compose_config(["ft=torchft", f"ft.replica_id={replica_id}"])
        assert decides_run_dir(cfg) is decides, replica_id
    monkeypatch.setenv("RANK", "1")
    assert not decides_run_dir(plain)

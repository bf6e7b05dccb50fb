"""Which run directory a command trains in, so that the same command continues a stopped run.

`hydra.run.dir` is a timestamped pattern by default (`outputs/${now:...}/${now:...}`): each
command would get a new directory and start from step 0. With `trainer.resume=auto` (the
default) the launcher looks under the pattern's fixed root (`outputs/`) for the newest run of
the same job and continues it, as Lightning's `ckpt_path="last"` does:

- the same job: the same overrides (`job.json` in each run directory records them, sorted; the
  `hydra.*` ones, which say where and how it runs, and `trainer.resume` are not part of it), so
  two different jobs never share a run;
- a run that has not finished (no `summary.json`: a finished run is never resumed by accident;
  train one further by naming its `hydra.run.dir` with a larger `trainer.max_steps`) and that
  holds a checkpoint marked complete;
- not in use: a live job holds its run directory's `.lock` (an flock, released when the job's
  launcher exits however it ends), so two commands started at once never share a directory;
- under SLURM, a requeued job (`SLURM_RESTART_COUNT` > 0) takes the run its `SLURM_JOB_ID`
  (and array task) wrote first, whichever is newer.

A fixed `hydra.run.dir` (no `${now:...}`) is used as given: it continues if it holds checkpoints.
`trainer.resume=never` always starts a new run; a path resumes from there.
"""

from __future__ import annotations

import datetime
import fcntl
import glob
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass

from localsgd.config import ConfigError

JOB_FILE = "job.json"
LOCK_FILE = ".lock"
_SAFE = re.compile(r"^[\w./,:@+-]+$")


def job_overrides(args: list[str], config_dirs: list[str]) -> list[str]:
    """The job's identity: its command-line overrides, sorted, without those that say where
    and how it runs (`hydra.*`, `hydra/launcher=...`) or whether it resumes."""
    kept = []
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if arg.startswith("-") or key.startswith("hydra") or key == "trainer.resume":
            continue
        kept.append(arg)
    return sorted(kept) + [f"--config-dir={d}" for d in config_dirs]


def slurm_job() -> dict[str, str] | None:
    """This process's SLURM job (id, array task, restart count), or None outside SLURM."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return {
        "job_id": job_id,
        "array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID", ""),
        "restart_count": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }


def pattern_root(pattern: str) -> tuple[str, int] | None:
    """A timestamped `hydra.run.dir` pattern's fixed root and how many folders deep its runs
    lie (`outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}`: ("outputs", 2)); None for a fixed path."""
    if "${now:" not in pattern:
        return None
    parts = pattern.replace(os.sep, "/").split("/")
    fixed = next(i for i, p in enumerate(parts) if "${" in p)
    root = "/".join(parts[:fixed]) or "."
    return root, len(parts) - fixed


# --- the lock -------------------------------------------------------------------------------


class RunLock:
    """The `.lock` flock a live job holds on its run directory (released when its process
    exits, however it ends); `holder` names the pid written into it."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.file = None

    def acquire(self, claim: bool = True) -> bool:
        """Take the lock (False: a live job holds it); `claim`: write this pid into it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115  (held for the job's life)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process holds it
            f.close()
            return False
        except OSError:  # a filesystem without locks (some NFS): nothing to tell, go on unlocked
            f.close()
            return True
        if claim:
            f.truncate(0)
            f.write(str(os.getpid()))
            f.flush()
        self.file = f
        return True

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor drops the flock
            self.file = None

    def holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as f:
                return f.read().strip() or "?"
        except OSError:
            return "?"


def in_use(run_dir: str) -> str | None:
    """The pid of the live job holding `run_dir`, or None when no job holds it."""
    if not os.path.exists(os.path.join(run_dir, LOCK_FILE)):
        return None
    lock = RunLock(run_dir)
    if lock.acquire(claim=False):
        lock.release()
        return None
    return lock.holder()


_held: dict[str, RunLock] = {}


def hold(run_dir: str) -> None:
    """Hold `run_dir` for this job (ConfigError if a live job holds it); `let_go` ends it."""
    key = os.path.abspath(run_dir)
    if key in _held:
        return
    lock = RunLock(run_dir)
    if not lock.acquire():
        raise in_use_error(run_dir, lock.holder())
    _held[key] = lock


def let_go(run_dir: str) -> None:
    lock = _held.pop(os.path.abspath(run_dir), None)
    if lock is not None:
        lock.release()


def in_use_error(run_dir: str, pid: str) -> ConfigError:
    return ConfigError(
        f"hydra.run.dir: {run_dir} is in use by a running job (pid {pid}); wait for it to end, "
        f"or choose another directory"
    )


# --- the job file ---------------------------------------------------------------------------


def write_job_file(run_dir: str, overrides: list[str]) -> None:
    """Record the job's overrides (and SLURM job) in its run directory, for `find_run`."""
    record = {"overrides": overrides, "written": datetime.datetime.now().isoformat()}
    slurm = slurm_job()
    if slurm is not None:
        record["slurm"] = slurm
    path = os.path.join(run_dir, JOB_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def _read_job(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, JOB_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# --- finding the run to continue ------------------------------------------------------------


@dataclass
class Found:
    """What `find_run` found: the run to continue (or None), and a line for the user."""

    run_dir: str | None
    line: str | None


def find_run(root: str, depth: int, overrides: list[str], has_checkpoint) -> Found:
    """The newest run of the job `overrides` under `root` (`depth` folders down) that has not
    finished, holds a checkpoint (`has_checkpoint(run_dir)`) and no live job holds; under a
    SLURM requeue, the run its SLURM job wrote first. `line` says what was passed over."""
    pattern = os.path.join(root, *(["*"] * depth))
    same = []
    for run_dir in glob.glob(pattern):
        record = _read_job(run_dir)
        if record is not None and record.get("overrides") == overrides:
            same.append((os.path.getmtime(os.path.join(run_dir, JOB_FILE)), run_dir, record))
    same.sort(reverse=True)
    slurm = slurm_job()
    if slurm is not None and slurm["restart_count"] not in ("", "0"):

        def this_job(rec: dict) -> bool:
            theirs = rec.get("slurm") or {}
            keys = ("job_id", "array_task_id")
            return all(theirs.get(k) == slurm[k] for k in keys)

        same.sort(key=lambda item: not this_job(item[2]))  # stable: newest first within each
    passed_over = None
    for _, run_dir, _ in same:
        if os.path.exists(os.path.join(run_dir, "summary.json")):
            continue  # finished: never resumed by accident
        pid = in_use(run_dir)
        if pid is not None:
            passed_over = passed_over or f"{run_dir} is running (pid {pid})"
            continue
        if not has_checkpoint(run_dir):
            passed_over = passed_over or f"{run_dir} stopped before its first checkpoint"
            continue
        return Found(run_dir, None)
    if passed_over is None:
        return Found(None, None)
    return Found(None, f"trainer.resume=auto: nothing of this job to continue ({passed_over}); "
                 f"starting a new run")  # fmt: skip


def new_run_dir(resolved: str) -> str:
    """`resolved` (the pattern as it resolves now), or with a suffix where another job made it
    already (two commands started within the same second); created here, so it is claimed."""
    candidate, n = resolved, 1
    while True:
        try:
            os.makedirs(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{resolved}-{n}"


# --- the command that continues a run -------------------------------------------------------


def quote_override(key: str, value: str) -> str:
    """`key=value` as Hydra parses it back: a value with `=` or other specials quoted."""
    if _SAFE.match(value):
        return f"{key}={value}"
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"{key}='{escaped}'"


def resume_command(args: list[str], run_dir: str) -> str:
    """The command that continues the run in `run_dir`: this one, with the directory named
    (outside torchrun; under torchrun, run the same torchrun command again)."""
    python = sys.executable
    if python.startswith(os.getcwd() + os.sep):
        python = os.path.relpath(python)
    kept = [a for a in args if not a.split("=", 1)[0].lstrip("+").startswith("hydra.run.dir")]
    kept.append(quote_override("hydra.run.dir", os.path.abspath(run_dir)))
    return shlex.join([python, "-m", "localsgd.train", *kept])

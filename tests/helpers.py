"""What the tests share: the small configs, the CLI in a subprocess (tagged, so a test can prove
no process outlived its job), the worker harness, and exact comparisons of runs."""

from __future__ import annotations

import atexit
import ctypes
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

import localsgd.cli.train  # noqa: F401  (registers the config schema)
from localsgd.cli.forkserver import start_method
from localsgd.cli.launch import run_on_workers as run_distributed  # noqa: F401  (the harness)
from localsgd.config import Config, typed
from tests import faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

# A quick CLI job: a synthetic classification set and a small MLP, no wandb.
FAST = [
    "data=synthetic",
    "data.num_samples=1200",
    "model=mlp",
    "model.hidden=[64]",
    "trainer.progress=false",
    "dist.timeout_s=60",
    "logger.wandb.mode=disabled",
    "logger.plots=false",  # ~0.5 s of matplotlib per job (tests/test_report.py plots)
]

# The reliability job: 24 steps, 2 workers; warmup steps 0-5 communicate, then averages after
# steps 6, 11, 16, 21. Checkpoints every 5 steps: the one at step 5 falls in the warmup, the one
# at 10 between syncs (step 9 was local, so the two replicas differ there).
BASE = [
    "data=synthetic",
    "data.num_samples=600",
    "model=mlp",
    "model.hidden=[16]",
    "model.dropout=0.1",  # so the per-rank RNG state matters for an exact resume
    "trainer.batch_size=8",
    "trainer.max_steps=24",
    "trainer.checkpoint_every=5",
    "trainer.log_every=4",
    "trainer.eval_every=8",
    "trainer.progress=false",
    "sync.warmup_steps=6",
    "sync.period=5",
    "dist.world_size=2",
    "dist.timeout_s=30",
    "logger.wandb.mode=disabled",  # wandb is not the subject here (tests/test_loggers.py)
    "logger.plots=false",  # nor plots (tests/test_report.py)
]

# In-process trainer tests (compose_config(SMALL + ...)).
SMALL = [
    "data=synthetic",
    "data.num_samples=800",
    "model=mlp",
    "model.hidden=[32]",
    "trainer.batch_size=8",
    "trainer.progress=false",
    "trainer.eval_every=1000",
]


def compose_config(overrides: list[str]) -> Config:
    """The typed, resolved config a worker receives, composed exactly as the CLI composes it."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return typed(cfg)


def tagged_env(extra: dict[str, str | None] | None = None) -> tuple[dict, str]:
    """os.environ, tagged, with `extra` set (a None value unsets the variable)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOCALSGD_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env, tag


def run(
    cmd: list[str],
    fault: str | None = None,
    timeout: float = 120,
    env: dict[str, str | None] | None = None,
    cwd: str = ROOT,
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run `cmd` (a training command: its last arguments are overrides) in `cwd`, with `fault`
    (tests/faults.py's KIND:RANK:STEP[:ONCE_FILE]) injected; returns the CompletedProcess and the
    processes it left behind."""
    full_env, tag = tagged_env(env)
    if fault:
        cmd = faults.with_fault(cmd, fault)
    proc = subprocess.run(
        cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return proc, survivors(tag)


def cli(
    args: list[str],
    fault: str | None = None,
    timeout: float = 120,
    env=None,
    cwd=ROOT,
    fresh: bool = False,
):
    """`python -m localsgd.train ARGS`: (CompletedProcess, processes left behind).

    The command runs as a process of its own, with that argv, environment (`env` as for `run`)
    and working directory, its own exit code and output, and its workers under it, but forked
    from this session's forkserver, which holds torch and the loop already: a fresh interpreter
    spends ~5 s of CPU importing them for every job. `fresh=True` starts a real interpreter, for
    what only one shows (`python -m` putting the current folder on the path); exit codes as a
    shell sees them, Ctrl-C, a killed launcher and the installed script are tested that way too.
    """
    if fault:
        args = faults.with_fault(args, fault)
    if fresh:
        return run([sys.executable, "-m", "localsgd.train", *args], None, timeout, env, cwd)
    full_env, tag = tagged_env(env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = multiprocessing.get_context(start_method()).Process(
            target=_train_command, args=(args, full_env, str(cwd), out, err, _comm(tag))
        )
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["localsgd.train", *args], timeout)
        with open(out) as o, open(err) as e:
            proc = subprocess.CompletedProcess(args, child.exitcode, o.read(), e.read())
    return proc, _lingering(tag)


# subprocess.run with captured output returns once every holder of the pipes is gone, wandb's
# service shutting down included; a forked command's descendants get this long to do the same.
_EXIT_GRACE_S = 10.0


def _lingering(tag: str) -> list[int]:
    deadline = time.monotonic() + _EXIT_GRACE_S
    while (left := survivors(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _train_command(args, env, cwd, out, err, comm) -> None:
    """What `python -m localsgd.train ARGS` does, in a child of the session's forkserver."""
    _set_comm(comm)  # its descendants inherit the name: the tag they cannot have in /proc/environ
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter: the server ignores it
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd, *paths]  # as `python -m` with PYTHONPATH puts them first
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [os.path.join(ROOT, "localsgd", "train.py"), *args]
    code = 1
    try:
        from localsgd.train import main

        main()
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what interpreter exit runs (it ends the workers' server)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_cli(args: list[str], timeout: float = 120, env=None, cwd=ROOT, fresh: bool = False):
    """`python -m localsgd.train ARGS` (a CompletedProcess), asserting that no process
    outlived it."""
    proc, left = cli(args, timeout=timeout, env=env, cwd=cwd, fresh=fresh)
    assert not left, f"processes left behind: {left}"
    return proc


def _comm(tag: str) -> str:
    return "t" + tag[:14]  # a process name holds 15 characters


def _set_comm(name: str) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


def survivors(tag: str) -> list[int]:
    """PIDs of live processes started with this tag in their environment, or, for a command
    forked by `cli`, under its tagged process name."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                tagged = f"LOCALSGD_TEST_TAG={tag}".encode() in f.read()
            with open(f"/proc/{pid}/stat") as s:
                name, state = s.read().split(" (", 1)[1].rsplit(") ", 1)
            if (tagged or name == _comm(tag)) and state[0] != "Z":
                found.append(int(pid))
        except OSError:
            continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ft=torchft job of the CLI tests: 3 workers, a replica group each, 60 steps, a sync every
# 4 after a 4-step synchronous warmup (tests/test_ft_cli.py and its kin add `ft=torchft`)
FT_JOB = FAST + [
    "data.num_samples=900",
    "dist.world_size=3",
    "trainer.max_steps=60",
    "trainer.batch_size=16",
    "trainer.log_every=4",
    "trainer.eval_every=1000",
    "trainer.checkpoint_every=0",
    "sync.warmup_steps=4",
    "sync.period=4",
    "logger=jsonl",
]


def three_paced_workers_under_ft(steps: int, run_dir, *extra: str) -> list[str]:
    """FT_JOB for `steps` steps under ft=torchft, each step lasting >= 50 ms (so that the job
    outlives the faults it is given), with `extra` overrides, in `run_dir`."""
    job = [f"trainer.max_steps={steps}" if a.startswith("trainer.max_steps=") else a
           for a in FT_JOB]  # fmt: skip
    return job + [
        "ft=torchft",
        "comm.simulate.worker_speed=[1,1,1]",
        "comm.simulate.step_s=0.05",
        *extra,
        f"hydra.run.dir={run_dir}",
    ]


def as_torchrun_rank(monkeypatch, world_size: int = 2) -> None:
    """This process's environment as rank 0 of a torchrun machine of `world_size` processes
    (undone after the test), for what the entry point's checks refuse under torchrun."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", str(world_size)), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999")):  # fmt: skip
        monkeypatch.setenv(key, value)


def torchrun_machine(args: list[str], env: dict, nproc: int = 2) -> subprocess.Popen:
    """One "machine" on loopback: `torchrun --nproc-per-node=NPROC -m localsgd.train ARGS` with
    a rendezvous of its own, restarted once by torchrun if a rank dies; output on stdout."""
    cmd = [
        TORCHRUN,
        f"--nproc-per-node={nproc}",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--monitor-interval=0.2",
        "-m",
        "localsgd.train",
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def same_model(a, b) -> bool:
    sa = torch.load(a, weights_only=True)
    sb = torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# measured times differ from run to run; everything else must match exactly
TIMING_KEYS = (
    "wall_time_s",
    "comm_seconds",
    "compute_seconds",
    "samples_per_s",
    "comm_share",
)


def train_records(run_dir) -> list[dict]:
    """metrics.jsonl without the fields that measure time."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append({k: v for k, v in record.items() if k not in TIMING_KEYS})
    return out


class CollectiveCounter:
    """Counts every torch.distributed collective called through the module's functions."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "barrier",
        "all_to_all",
        "reduce",
        "gather",
        "scatter",
        "broadcast_object_list",
        "all_gather_object",
    )

    def __init__(self):
        self.count = 0
        self._originals = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*a, _original=original, **k):
                self.count += 1
                return _original(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _launch_not_reached(*args, **kwargs):
    raise AssertionError("the input was not refused before the launch")


def refusal(args: list[str], capsys) -> str:
    """The one line `python -m localsgd.train ARGS` refuses ARGS with, got in-process: the
    entry point's checks run as in the CLI (exit code 2, one stderr line, no traceback), and
    the launch is replaced by a failure, so input the checks let through starts nothing."""
    from localsgd.cli import train as entry

    capsys.readouterr()
    with (
        mock.patch.object(sys, "argv", ["localsgd.train", *args]),
        mock.patch.object(entry, "main", _launch_not_reached),
        pytest.raises(SystemExit) as stop,
    ):
        entry.cli()
    out = capsys.readouterr()
    assert stop.value.code == 2, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err + out.out, out.err
    return lines[0]


def killed_and_resumed(args: list[str], tmp_path, kill: str = "kill:0:13"):
    """Train `args` uninterrupted, and again with a SIGKILL (`kill`, a tests/faults.py spec)
    after the step-10 checkpoint and the same command to resume; asserts the resumed run's final
    model is bit-identical. Returns the two run directories (reference, resumed)."""
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    proc, _ = cli(args + [f"hydra.run.dir={reference}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, left = cli(args + [f"hydra.run.dir={run_dir}"], fault=kill)
    assert proc.returncode == 1 and not left, proc.stderr[-2000:]
    proc, _ = cli(args + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0 and "step-10" in proc.stderr, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", reference / "model.pt")
    return reference, run_dir


def fake_cifar(root, per_batch: int = 40) -> None:
    """cifar-10-batches-py as Python 3 sees the official files: pickled dicts of uint8 rows."""
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": [int(v) for v in rng.integers(0, 10, per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))


def listening(port: int) -> list[str]:
    """The addresses (hex, as /proc/net shows them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    found.append(address)
    return found

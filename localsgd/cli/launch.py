"""Starting the workers: spawn local processes, or join the ones torchrun started."""

from __future__ import annotations

import contextlib
import datetime
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from localsgd.averaging.stores import serving_store
from localsgd.cli.forkserver import (  # noqa: F401  (under_torchrun re-exported)
    fork_from_here,
    server_status,
    start_method,
    under_torchrun,
)
from localsgd.cli.proctitle import set_title
from localsgd.loop.metrics import notice
from localsgd.loop.stop import announce
from localsgd.loop.worker import WorkerInfo  # noqa: F401  (re-exported for the CLI)


def torchrun_info() -> WorkerInfo:
    return WorkerInfo.from_torchrun()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("dist.device=cuda but CUDA is not available; use dist.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def pick_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    info: WorkerInfo, backend: str, timeout_s: float, store: dist.Store | None = None
) -> dist.Store:
    """Join the process group; returns the store it rendezvoused through."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:  # torchrun: env:// rendezvous
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's store outlives a restart, and gloo would read the dead workers' addresses
        # left in it (connectFullMesh times out): each attempt gets keys of its own.
        store = dist.PrefixStore(f"localsgd/attempt-{info.attempt}", store)
    dist.init_process_group(
        backend, store=store, rank=info.rank, world_size=info.world_size, timeout=timeout
    )
    return store


def resolve_world_size(requested: int | None, device: str) -> int:
    """`dist.world_size` as given, or when null: one per GPU on CUDA machines, else 4."""
    if requested is not None:
        return requested
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 4


def _spawned(
    local_rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    environ: dict[str, str],
    fn: Callable,
    args: tuple,
) -> None:
    # Ctrl-C reaches the whole process group; the launcher alone decides what it means (a stop
    # at the next sync, then an abort), so a worker never dies of KeyboardInterrupt mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The server ignores SIGTERM (`forkserver.become_server`); `fn` decides what it means here
    # (the trainer: a stop at an agreed step), anything else ends as a process normally does.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_launcher()
    launcher = multiprocessing.parent_process()
    set_title(
        f"localsgd worker {local_rank}/{world_size}"
        + (f" (launcher {launcher.pid})" if launcher is not None else "")
    )
    # A forkserver child inherits the environment the server started with, not the launcher's
    # of now (a test, or a second job in one process, may have changed it since).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size + 1,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    info = WorkerInfo(local_rank, world_size, local_rank, world_size)
    fn(info, store, *args)
    # Done and torn down: leave without interpreter teardown. Destroying the store's and gloo's
    # native threads at exit has aborted a finished worker ("terminate called without an active
    # exception", SIGABRT) about once in a hundred runs here, failing a job that had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_launcher() -> None:
    """SIGKILL this worker as soon as the launcher is gone, however it went, so that no worker
    outlives a killed job.

    A thread waits on the launcher's end of a pipe, which the kernel closes when the launcher
    dies. The kernel's parent-death signal would not do: the parent is the forkserver, which
    lives on while any worker holds its pipe.
    """
    launcher = multiprocessing.parent_process()
    if launcher is None:
        return

    def watch() -> None:
        launcher.join()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


# After one worker fails, the others get SIGTERM and this long to exit, then SIGKILL (torch's
# default waits 30 s, and a worker in a long local phase would not notice a dead peer sooner).
_FAILURE_GRACE_S = 2.0


class WorkerFailed(RuntimeError):
    """A spawned worker raised or died; the message names the rank and the error's last line.
    `raised`: it raised (its whole traceback is in the run's log, `cli.train.run_worker`)."""

    def __init__(self, message: str, raised: bool = False):
        super().__init__(message)
        self.raised = raised


# How long a worker read as dead with exit code 255 waits for its server's exit to be seen.
_SERVER_EXIT_WAIT_S = 1.0


def _server_died(context) -> str | None:
    """The line for a dead workers' server, after SIGKILLing the workers; None while it runs.

    Every worker's exit code comes through the server, so once it is gone each one reads as
    dead with code 255 although it still runs, and nothing would end it but the launcher's exit
    (its peers then hang in collectives until `dist.timeout_s`)."""
    # The server's sockets close before the kernel makes it a zombie: give its exit a moment.
    deadline = time.monotonic() + _SERVER_EXIT_WAIT_S
    while (status := server_status()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if status is None:
        return None
    for p in context.processes:
        if p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    return (
        f"the workers' forkserver (pid {multiprocessing.forkserver._forkserver._forkserver_pid}) "
        f"died ({status}); the workers were stopped, the last complete checkpoint is kept"
    )


# What gloo raises in a worker whose peer's process is gone: a consequence, not the cause.
_PEER_LOST = ("closed by peer", "reset by peer")


def _lost_a_peer(line: str) -> bool:
    return any(phrase in line for phrase in _PEER_LOST)


def _peer_that_died(context, raised: int) -> str | None:
    """The line for a worker killed by a signal, when another worker's error only says that its
    connection to a peer closed: under load the survivor's exception can reach the launcher
    before the dead worker's exit does, and the line should name the cause. Signals the
    launcher's own clean-up sends (SIGTERM) are not a cause."""
    for rank, process in enumerate(context.processes):
        code = process.exitcode
        if rank != raised and code is not None and code < 0 and -code != signal.SIGTERM:
            return f"worker rank {rank} died with exit code {code}"
    return None


def spawn(
    fn: Callable, world_size: int, timeout_s: float, args: tuple = ()
) -> signal.Signals | None:
    """Run `fn(info, store, *args)` in `world_size` processes on this machine, forked from a
    server that holds the imports (`localsgd.cli.forkserver`).

    The parent holds a TCPStore on a port the OS picks, so concurrent jobs never collide; if one
    worker fails, torch terminates the others and we raise WorkerFailed. Returns the first stop
    signal this process got (SIGTERM, SIGINT), which it forwarded to the workers, or None.
    """
    fork_from_here()  # before the store's threads start (`python -m localsgd.train` did already)
    # on the loopback only (a TCPStore of its own listens on every interface)
    serving = serving_store("127.0.0.1", datetime.timedelta(seconds=timeout_s))
    store = serving.store
    # One thread per worker: more would oversubscribe the cores the workers share.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    tell_workers = functools.partial(announce, store)  # which signal it was (stop.announce)
    interrupts = 0
    stopped_by: signal.Signals | None = None
    try:
        context = mp.start_processes(
            _spawned,
            args=(world_size, store.port, timeout_s, dict(os.environ), fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method(),
        )

        def forward(signum, frame):  # SLURM / the user stops the launcher: workers checkpoint
            nonlocal stopped_by
            if stopped_by is None:
                stopped_by = signal.Signals(signum)
                tell_workers(signum)  # so their line names Ctrl-C, not the SIGTERM they get
            for p in context.processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

        def interrupt(signum, frame):  # Ctrl-C: the first stops like SIGTERM, the second aborts
            nonlocal interrupts
            interrupts += 1
            if interrupts == 1:
                notice(
                    "Ctrl-C: stopping at the next sync with a checkpoint (run the same command "
                    "again to resume; Ctrl-C again to abort without one)"
                )
                forward(signum, frame)
                return
            for p in context.processes:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            notice("Ctrl-C: aborted; the last complete checkpoint is kept")
            os._exit(130)  # no traceback from Hydra's frames: the workers are gone

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, interrupt)
        while not context.join(grace_period=_FAILURE_GRACE_S):
            pass
        return stopped_by
    except mp.ProcessExitedException as e:
        died = _server_died(context) if e.exit_code == 255 else None
        if died is not None:
            raise WorkerFailed(died) from None
        raise WorkerFailed(
            f"worker rank {e.error_index} died with exit code {e.exit_code}"
        ) from None
    except mp.ProcessRaisedException as e:
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
        cause = _peer_that_died(context, e.error_index) if _lost_a_peer(last) else None
        if cause is not None:
            raise WorkerFailed(cause) from None
        raise WorkerFailed(f"worker rank {e.error_index} failed: {last}", raised=True) from None
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        del store, serving  # the store stops serving, and its socket closes
        sys.stdout.flush()


def _run_and_save(info: WorkerInfo, store, fn, args, out_dir: str, backend: str, timeout_s: float):
    init_process_group(info, backend, timeout_s, store)
    try:
        try:
            result = fn(info.rank, info.world_size, *args)
        except BaseException:
            traceback.print_exc()  # WorkerFailed names only the last line; show where
            raise
        torch.save(result, os.path.join(out_dir, f"{info.rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_on_workers(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 60.0, backend: str = "gloo"
) -> list:
    """`fn(rank, world_size, *args)` in `world_size` worker processes joined in a process group;
    returns what each rank returned (picklable), in rank order. The harness the tests and the
    benchmarks share; `fn` must be importable (a module-level function)."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_run_and_save, world_size, timeout_s, args=(fn, args, out_dir, backend, timeout_s))
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]

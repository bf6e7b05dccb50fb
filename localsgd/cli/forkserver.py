"""The process local workers are forked from, so that a worker starts in milliseconds instead of
spending seconds of CPU importing torch and the training loop again.

Two ways to start it, chosen by `LOCALSGD_FORKSERVER`:

- `forked` (the default): `python -m localsgd.train`, and any other single-threaded caller of
  `spawn` (Linux), forks the server from itself once its imports are done, so the server holds
  them without importing anything twice. This sets four private fields of CPython's
  `multiprocessing.forkserver`, so it runs only where that was tested: CPython 3.11
  (`TESTED_PYTHONS`) with a forkserver that does not authenticate its clients (newer CPython
  sends an authentication key, which this server would skip). Anywhere else it falls back to:
- `public`: multiprocessing starts the server as a fresh interpreter that imports PRELOAD once
  for all workers (`set_forkserver_preload`), as it also does from a process with more threads
  (a pytest-xdist worker) and on macOS.

docs/testing.md has what the forked server saves over the public path.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import inspect
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
import threading
from multiprocessing import connection, resource_tracker

# Set by torchrun for each worker it starts itself: then there is nothing to fork.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Every optimizer's constructor imports torch._dynamo (add_param_group is wrapped by
# torch._disable_dynamo): ~2 s of CPU per worker if it were not here. localsgd.cli.launch holds
# the function each worker starts in.
# localsgd.cli.forkserver_init, imported by the server alone, makes it one (`become_server`).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "localsgd.loop.trainer",
    "localsgd.cli.launch",
    "localsgd.cli.forkserver_init",
]

# The (major, minor) CPython versions whose multiprocessing.forkserver the forked server was
# checked against, and which the test suite runs on; any other takes the public path.
TESTED_PYTHONS = ((3, 11),)

# LOCALSGD_FORKSERVER=forked|public picks how the server starts (`server_kind`).
ENV = "LOCALSGD_FORKSERVER"
KINDS = ("forked", "public")

_stop_registered = False
# The private fields of multiprocessing.forkserver.ForkServer (as of CPython 3.11) used here.
_SERVER_FIELDS = ("_lock", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd")
# multiprocessing.forkserver.main as CPython 3.11 defines it: the forked server calls it so.
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def forked_server_supported() -> bool:
    """Whether this interpreter's forkserver is the one the forked server copies: CPython of a
    tested version, whose server takes no authentication key, with the fields set here."""
    if sys.implementation.name != "cpython" or sys.version_info[:2] not in TESTED_PYTHONS:
        return False
    module = multiprocessing.forkserver
    if hasattr(module, "_AUTHKEY_LEN"):  # its clients authenticate: keep that, its own server
        return False
    if tuple(inspect.signature(module.main).parameters) != _MAIN_PARAMETERS:
        return False
    return all(hasattr(module._forkserver, a) for a in _SERVER_FIELDS)


def server_kind() -> str:
    """`forked` or `public`: what LOCALSGD_FORKSERVER asks for (default `forked`), `public`
    wherever the forked server is not supported."""
    asked = os.environ.get(ENV, "forked") or "forked"
    if asked not in KINDS:
        raise ValueError(f"{ENV}={asked!r}: expected one of {', '.join(KINDS)}")
    return "forked" if asked == "forked" and forked_server_supported() else "public"


def start_method() -> str:
    """'forkserver' with PRELOAD where the platform has it, else 'spawn' (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    _stop_at_exit()
    return "forkserver"


def fork_from_here() -> None:
    """Start the server as a fork of this process, which has imported what workers need.

    It then imports the rest of PRELOAD while this process composes its config. Call it before
    this process touches CUDA; in a process with more than one thread it does nothing, and the
    first spawn starts a fresh server instead. Linux only (fork after importing torch is
    not safe on macOS), and not under torchrun, whose workers are started by torchrun.
    """
    if under_torchrun() or not sys.platform.startswith("linux") or start_method() == "spawn":
        return
    if server_kind() == "public":
        return  # multiprocessing's own server (a fresh interpreter), started at the first spawn
    if len(os.listdir("/proc/self/task")) > 1:
        return  # another thread may hold a lock the fork would copy held: a fresh one, then
    server = multiprocessing.forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return
        resource_tracker.ensure_running()  # the server hands its fd to every worker
        # What multiprocessing.forkserver.ForkServer.ensure_running does, with fork for exec.
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the server: serves until every process holding alive_w is gone
            code = 1
            try:
                _die_with_parent()
                become_server("forked")
                server._lock = threading.Lock()  # the copy is held (by the parent's `with`)
                os.close(alive_w)
                multiprocessing.forkserver.main(listener.fileno(), alive_r, PRELOAD)
            except SystemExit:
                code = 0
            finally:
                os._exit(code)  # never this process's atexit handlers: they are the launcher's
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


_became: str | None = None  # how this process became the server, once it has


def become_server(how: str = "fresh interpreter") -> None:
    """What makes this process the workers' server, beyond multiprocessing's own setup.

    SLURM and Kubernetes send SIGTERM to every process of a job at pre-emption. The workers
    answer it with a checkpoint at an agreed step, which they can only finish while the server
    lives: the launcher learns each worker's exit through it, and reads a dead server as every
    worker dead (exit code 255). So the server ignores SIGTERM; it still ends with the launcher
    (the kernel's parent-death signal, or its `alive` pipe closing) and with SIGKILL. Workers
    inherit the ignored SIGTERM until `launch._spawned` restores it. `how` goes into the title:
    `forked` from the launcher, or a `fresh interpreter` multiprocessing started.
    """
    global _became
    from localsgd.cli.proctitle import set_title

    if _became is not None:  # the forked server imports PRELOAD too
        return
    _became = how
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_title(f"localsgd forkserver (launcher {os.getppid()}, {how})")


def server_status(pid: int | None = None) -> str | None:
    """How the workers' server ended (`exit code N` or `killed by SIGNAME`), or None while it
    runs or if there is none. It is this process's child; it is not reaped here, so that
    multiprocessing's own `_stop` can still wait for it."""
    if pid is None:
        pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None  # not our child (nothing to tell), or already reaped
    if ended is None:
        return None
    if ended.si_code == os.CLD_EXITED:
        return f"exit code {ended.si_status}"
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(ended.si_status).name}"
    return f"killed by signal {ended.si_status}"


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop_at_exit() -> None:
    global _stop_registered
    if not _stop_registered:
        atexit.register(stop)
        _stop_registered = True


def stop() -> None:
    """End the server with the process that started it, even mid-import (a refused input exits
    within a second), so that no process outlives the job."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()

"""The process local workers are forked from, so that a worker starts in milliseconds instead of
spending seconds of CPU importing torch and the training loop again.

`python -m localsgd.train`, and any other single-threaded caller of `spawn` (Linux), forks it
from itself once its imports are done, so the server holds them without importing anything twice;
elsewhere (a process with more threads, such as a pytest-xdist worker, or macOS) multiprocessing
starts it as a fresh interpreter that imports PRELOAD once for all workers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
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
# torch._disable_dynamo): ~2 s of CPU per worker if it were not here.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "localsgd.loop.trainer"]

_stop_registered = False
# The private fields of multiprocessing.forkserver.ForkServer (as of CPython 3.11) used here.
_SERVER_FIELDS = ("_lock", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd")


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


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
    if len(os.listdir("/proc/self/task")) > 1:
        return  # another thread may hold a lock the fork would copy held: a fresh one, then
    server = multiprocessing.forkserver._forkserver
    if not all(hasattr(server, a) for a in _SERVER_FIELDS):
        return  # another CPython's internals: its own server then (a fresh interpreter)
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

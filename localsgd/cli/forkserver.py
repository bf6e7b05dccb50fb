"""The process local workers are forked from: it imports torch and the training loop once, so a
worker starts in milliseconds instead of spending seconds of CPU importing them again.

Standard library only: `python -m localsgd.train` starts the server before it imports torch
itself, so the two imports run side by side.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

# Set by torchrun for each worker it starts itself: then there is nothing to fork.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# torch._dynamo is imported lazily by an optimizer's first step: ~2 s of CPU per worker if not here.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "localsgd.loop.trainer"]


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def start_method() -> str:
    """'forkserver' with PRELOAD where the platform has it, else 'spawn' (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def warm_up() -> None:
    """Start the server now, in the background, for a launcher that is about to import torch
    and compose its config; torchrun's workers are started by torchrun instead."""
    if under_torchrun() or start_method() != "forkserver":
        return
    multiprocessing.forkserver.ensure_running()
    atexit.register(stop)


def stop() -> None:
    """End the server with the launcher, even while it is still importing (a refused input exits
    within a second), so that no process outlives the job that started it."""
    server = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()

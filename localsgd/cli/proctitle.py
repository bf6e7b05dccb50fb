"""Process titles, so that `ps`, `pgrep -f` and `htop` tell the processes of a job apart:
`localsgd launcher: OVERRIDES`, `localsgd forkserver (launcher PID)`, `localsgd worker R/W
(launcher PID)`; under torchrun `localsgd worker R/W (torchrun)`.

Through `setproctitle` (a dependency; without it titles stay as they are). Two of its defaults
are undone here:

- it moves the environment to make room for a long title, after which /proc/PID/environ shows
  the title instead of the variables: `SPT_NOENV` keeps the environment where it is, so a title
  is at most as long as the command line was (longer ones are cut; each title here starts with
  what tells the process apart);
- it also renames the process (the 15-character kernel name `top` and `ps -e` show): the name
  is put back, since it is inherited by every process a job starts and whoever started the job
  may have chosen it to find them all (the test harness does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

_PR_SET_NAME = 15


def set_title(title: str) -> None:
    """This process's command line as `ps` shows it; a no-op without setproctitle."""
    try:
        import setproctitle
    except ImportError:
        return
    name = _kernel_name()
    added = "SPT_NOENV" not in os.environ
    os.environ.setdefault("SPT_NOENV", "1")  # read at setproctitle's first call
    try:
        setproctitle.setproctitle(title)
    finally:
        if added:
            os.environ.pop("SPT_NOENV", None)
    if name is not None:
        _set_kernel_name(name)


def launcher_title(argv: list[str]) -> str:
    return " ".join(["localsgd launcher:", *argv])


def _kernel_name() -> bytes | None:
    try:
        with open("/proc/self/comm", "rb") as f:
            return f.read().rstrip(b"\n")
    except OSError:
        return None


def _set_kernel_name(name: bytes) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name, 0, 0, 0)

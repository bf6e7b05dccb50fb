"""The agreed stop: SIGTERM (and a first Ctrl-C) stops every rank after the same sync step, with
a checkpoint, without a collective between syncs."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import torch.distributed as dist

from localsgd.loop.metrics import notice

# ----------------------------------------------------------------------------------------------
# SIGTERM: stop at a step every rank agrees on, without a collective between syncs.
#
# The signal only sets a flag. A rank that sees the flag before executing step s proposes to stop
# after N, the first sync step >= s, by writing N+1 into the rendezvous store (first writer wins).
# No rank can finish step N's collective before the proposer joins it, which happens after the
# write, and every rank reads the store right after each sync step's collective: so every rank
# learns the stop step at N+1 at the latest, and stops exactly there. The cost between syncs is
# nothing; at each sync one store lookup (a key check, not a collective).
# ----------------------------------------------------------------------------------------------

_signalled = False
_first_signal: int | None = None

# A run stopped with a checkpoint, to be resumed, exits as a process killed by the signal would
# exit in a shell (128 + its number), so that a scheduler or script tells it from a finished run
# (0) and from a failed one (1, 2).
STOPPED_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def stopped_exit_code(signum: int | None) -> int:
    """The exit code of a run stopped by `signum` (SIGTERM's when not known: a worker was
    signalled, not the launcher)."""
    return STOPPED_EXIT_CODES.get(signum, STOPPED_EXIT_CODES[signal.SIGTERM])


def _on_sigterm(signum, frame) -> None:
    global _signalled, _first_signal
    _signalled = True
    if _first_signal is None:
        _first_signal = signum


def signalled() -> bool:
    """Whether SIGTERM (or a first Ctrl-C) has reached this process."""
    return _signalled


def first_signal() -> int | None:
    """The signal that asked this process to stop (SIGTERM or SIGINT), or None."""
    return _first_signal


def _on_sigint(signum, frame) -> None:
    if _signalled:  # a second Ctrl-C: abort now, without a checkpoint or a traceback
        notice("Ctrl-C: aborted; the last complete checkpoint is kept")
        os._exit(130)
    _on_sigterm(signum, frame)


def install_sigterm_handler() -> None:
    """SIGTERM asks for the agreed stop. So does a first Ctrl-C where it reaches this process
    (under torchrun; workers we spawn ignore SIGINT and leave it to the launcher)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_sigint)


class StopAgreement:
    def __init__(self, store: dist.Store | None, run_id: str):
        self.store = store  # the rendezvous store; None: a lone process decides alone
        self.key = f"localsgd/stop/{run_id}"
        self.stop_at: int | None = None
        self.proposed = False

    def before_step(self, step: int, find_next_sync: Callable[[int], int | None]) -> None:
        """`find_next_sync(step)`: the first step index >= `step` that communicates (None if none
        is left); called only once a signal arrived, since it is not free every step."""
        if not _signalled or self.proposed or self.stop_at is not None:
            return
        self.proposed = True
        next_sync = find_next_sync(step)
        if next_sync is None:
            return  # no sync left: the run ends (with its final checkpoint) before anyone could
        if self.store is None:
            self.stop_at = next_sync + 1
            return
        stored = self.store.compare_set(self.key, "", str(next_sync + 1))
        self.stop_at = int(stored)

    def after_sync(self) -> None:
        if self.stop_at is None and self.store is not None and self.store.check([self.key]):
            self.stop_at = int(self.store.get(self.key))

    def should_stop(self, steps_done: int) -> bool:
        global _agreed
        _agreed = self.stop_at
        return self.stop_at is not None and steps_done >= self.stop_at


_agreed: int | None = None


def agreed_stop() -> int | None:
    """The step count this process's run agreed to stop after (it stopped there if that is
    below trainer.max_steps, else it finished), or None."""
    return _agreed

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
# The signal only sets a flag. Each sync step N has a key of its own in the rendezvous store,
# written once: every rank, right after N's collective, marks it "go" unless it holds something
# already (compare_set: one store round trip), and stops after N if it reads "stop". A rank that
# sees the flag before executing step s proposes "stop" for the first sync step N >= s; its
# compare_set fails where a rank has already passed N (the key reads "go"), and it then tries the
# next sync, until one holds "stop". A key never changes once written, so every rank reads the
# same value at N, and all stop after the first sync whose key reads "stop".
#
# Why not one key and "no rank finishes step N's collective before the proposer joins it": under
# sync.overlap (any delayed average) the proposer joined the merge step's collective a step
# before it proposed, so a faster rank could pass that merge, and its check, before the write,
# and stop a sync later than the rest (a checkpoint of mismatched steps, exit 1). The proposer
# cannot know that from the schedule alone; the key tells it. The cost between syncs is nothing;
# at each sync one store compare_set per rank (and on rank 0 the delete of an old key).
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


# What stopped the job, as the launcher got it: its workers ignore SIGINT and receive a first
# Ctrl-C forwarded as SIGTERM, so their line would otherwise name the wrong one.
SIGNAL_KEY = "localsgd/stop/signal"


def announce(store: dist.Store, signum: int) -> None:
    """The launcher's record of the signal it forwards (before it forwards it)."""
    store.set(SIGNAL_KEY, signal.Signals(signum).name)


def install_sigterm_handler() -> None:
    """SIGTERM asks for the agreed stop. So does a first Ctrl-C where it reaches this process
    (under torchrun; workers we spawn ignore SIGINT and leave it to the launcher)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_sigint)


# Rank 0 deletes a sync's key this many syncs after checking it: no rank, and no proposer, is
# that far behind it (a rank cannot finish a collective its peers have not joined, and a delayed
# average is merged by the next sync at the latest).
_KEEP_KEYS = 8


class StopAgreement:
    def __init__(self, store: dist.Store | None, run_id: str, cleans: bool | None = None):
        self.store = store  # the rendezvous store; None: a lone process decides alone
        self.prefix = f"localsgd/stop/{run_id}"
        self.stop_at: int | None = None
        self.proposed = False
        # the rank that deletes old keys (rank 0 of the process group by default)
        if cleans is None:
            cleans = not dist.is_initialized() or dist.get_rank() == 0
        self.cleans = cleans
        self.checked: list[str] = []

    def _key(self, sync_step: int) -> str:
        return f"{self.prefix}/{sync_step}"

    def before_step(self, step: int, find_next_sync: Callable[[int], int | None]) -> None:
        """`find_next_sync(step)`: the first step index >= `step` that communicates (None if none
        is left); called only once a signal arrived, since it is not free every step."""
        if not _signalled or self.proposed or self.stop_at is not None:
            return
        self.proposed = True
        candidate = find_next_sync(step)
        while candidate is not None:  # no sync left: the run ends (with its final checkpoint)
            if self.store is None:
                self.stop_at = candidate + 1
                return
            if self.store.compare_set(self._key(candidate), "", "stop") == b"stop":
                self.stop_at = candidate + 1
                return
            candidate = find_next_sync(candidate + 1)  # a rank passed it already: the next one

    def after_sync(self, step: int) -> None:
        """Right after sync step `step`'s collective: stop after it if a proposal says so."""
        if self.store is None:
            return
        key = self._key(step)
        if self.store.compare_set(key, "", "go") == b"stop" and self.stop_at is None:
            self.stop_at = step + 1
        if self.cleans:
            self.checked.append(key)
            if len(self.checked) > _KEEP_KEYS:
                self.store.delete_key(self.checked.pop(0))

    def reason(self) -> str:
        """What the stop line names: Ctrl-C or SIGTERM, as the launcher got it (`announce`),
        else as this process did."""
        signum = first_signal()
        if self.store is not None and self.store.check([SIGNAL_KEY]):
            signum = signal.Signals[self.store.get(SIGNAL_KEY).decode()]
        return "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"

    def should_stop(self, steps_done: int) -> bool:
        global _agreed
        _agreed = self.stop_at
        return self.stop_at is not None and steps_done >= self.stop_at


_agreed: int | None = None


def agreed_stop() -> int | None:
    """The step count this process's run agreed to stop after (it stopped there if that is
    below trainer.max_steps, else it finished), or None."""
    return _agreed

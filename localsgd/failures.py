"""What the trainer does when things go wrong: SIGTERM, NaN losses, diverged replicas, and the
fault injection the tests use to make a failure land at an exact step."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

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


def _on_sigterm(signum, frame) -> None:
    global _signalled
    _signalled = True


def _on_sigint(signum, frame) -> None:
    if _signalled:  # a second Ctrl-C: abort now, without a checkpoint or a traceback
        print("Ctrl-C: aborted; the last complete checkpoint is kept", file=sys.stderr, flush=True)
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
        return self.stop_at is not None and steps_done >= self.stop_at


# ----------------------------------------------------------------------------------------------
# NaN / inf losses.
# ----------------------------------------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    pass


class NonFiniteTracker:
    """Remembers, on the device, the first step whose loss was not finite: no host sync per step
    (a `.item()` every step would stall CUDA); `check()` reads it at log and checkpoint steps."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        bad = (~torch.isfinite(loss)) & (self.first_bad < 0)
        self.first_bad = torch.where(bad, torch.full_like(self.first_bad, step), self.first_bad)

    def check(self, rank: int) -> None:
        step = int(self.first_bad)
        if step >= 0:
            raise NonFiniteLoss(
                f"non-finite loss at step {step} on rank {rank}; lower optim.lr, or set "
                f"trainer.nan_policy=skip to skip such steps (the last checkpoint is kept)"
            )


# ----------------------------------------------------------------------------------------------
# Replica check: after a sync, every rank's parameters must be bit-identical.
# ----------------------------------------------------------------------------------------------


class ReplicasDiverged(RuntimeError):
    pass


def replica_checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums over the raw bits (all words, odd-position words), accumulated without a
    converted copy: equal bits give equal sums, and any single changed word changes the first."""
    sums = torch.zeros(2, dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        bits = t.detach().reshape(-1).view(_int_dtype(t.dtype))
        sums[0] += bits.sum(dtype=torch.int64)
        sums[1] += bits[1::2].sum(dtype=torch.int64)
    return sums


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def check_replicas(buffers: list[torch.Tensor], step: int, rank: int) -> None:
    mine = replica_checksum(buffers)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    differ = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differ:
        raise ReplicasDiverged(
            f"replicas differ after the sync at step {step}: rank(s) {differ} do not match "
            f"rank 0 (checked on rank {rank}; sync.check_replicas=true)"
        )


# ----------------------------------------------------------------------------------------------
# Fault injection, a testing aid: LOCALSGD_FAULT="KIND:RANK:STEP[:ONCE_FILE]" makes rank RANK,
# before step STEP (0-based), `raise` an exception, `kill` itself with SIGKILL, send `sigterm`
# to its parent (the launcher), make its loss `nan`, or `desync` its parameters after the step.
# With ONCE_FILE it fires only if that file does not exist yet (and creates it), so a restarted
# worker does not fail again.
# ----------------------------------------------------------------------------------------------


class Fault:
    def __init__(self, rank: int):
        spec = os.environ.get("LOCALSGD_FAULT", "")
        self.kind, self.step, self.once = "", -1, None
        if spec:
            kind, fault_rank, step, *once = spec.split(":", 3)
            if int(fault_rank) == rank:
                self.kind, self.step = kind, int(step)
                self.once = once[0] if once else None

    def fires(self, kind: str, step: int) -> bool:
        if self.kind != kind or self.step != step:
            return False
        if self.once is not None:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return False
        return True

    def before_step(self, step: int) -> None:
        if self.fires("raise", step):
            raise RuntimeError(f"injected fault at step {step} (LOCALSGD_FAULT)")
        if self.fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires("sigterm", step):  # as SLURM would: to the launcher, which forwards it
            os.kill(os.getppid(), signal.SIGTERM)
            # Wait for the forwarded signal, so that where the ranks stop does not depend on how
            # fast the launcher relays it (a tiny job can otherwise end first).
            deadline = time.monotonic() + 10.0
            while not _signalled and time.monotonic() < deadline:
                time.sleep(0.001)

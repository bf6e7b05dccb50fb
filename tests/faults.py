"""Fault injection for the tests, as a trainer callback (`trainer.callbacks`): nothing in the
package knows about it. `Fault(spec="KIND:RANK:STEP[:ONCE_FILE]")` makes rank RANK, at step STEP
(0-based), `raise` an exception, `kill` itself with SIGKILL, send `sigterm` to its parent (the
launcher), make its loss `nan` (the model's output is poisoned for that step), or `desync` its
parameters after the step. With ONCE_FILE it fires only if that file does not exist yet (and
creates it), so a restarted worker does not fail again.

`freeze:RANK:STEP:SECONDS` (ft=torchft) freezes rank RANK inside its next torchft round from step
STEP on: at the round's first collective a helper process sends it SIGSTOP, then SIGCONT
SECONDS later, as a swapping host or a hung link would (a process cannot stop and wake itself).

`partition:RANK:STEP:SECONDS` (ft=torchft) cuts rank RANK's data plane from step STEP on: its
next round's collectives send nothing for SECONDS (the training thread holds them back) while
the process, its torchft manager and their heartbeats to the lighthouse run on, as a worker
whose collective traffic is blocked but whose control traffic is not. It is not a cut at the
network level (that needs rules on the shared loopback); its peers see the same thing: no
bytes from it, and a lighthouse that still hears it.

`freeze` and `partition` under asynchronous rounds (`sync.mode=async`) hold the worker's next
exchange with the syncer instead (in flight, `sync.overlap`: its messages, in their thread,
while the training thread goes on). `sever:RANK:STEP` (asynchronous rounds under ft=torchft)
breaks rank RANK's session with the syncer at its next exchange: the first tensor it sends
fails, as over a connection that dropped mid-transfer.

`wait:RANK:STEP:FILE` makes rank RANK wait at step STEP until FILE exists (at most 120 s): a
live group that must not finish before a restarted one is back (`Arrival` writes FILE).

From the command line: `trainer.callbacks=[{_target_:tests.faults.Fault,spec:'kill:1:7'}]`
(`override(spec)` writes that), run from the repository root so that `tests` is importable.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import subprocess
import time

import torch

from localsgd.loop import stop


def override(spec: str) -> str:
    return f"trainer.callbacks=[{{_target_:tests.faults.Fault,spec:'{spec}'}}]"


def with_fault(args: list[str], spec: str) -> list[str]:
    """`args` with the fault `spec` injected: added to a `trainer.callbacks=[...]` list already
    there (an attack, say), which a second `trainer.callbacks=` would silently replace."""
    entry = override(spec).removeprefix("trainer.callbacks=[").removesuffix("]")
    for i, arg in enumerate(args):
        if arg.startswith("trainer.callbacks=[") and arg.endswith("]"):
            listed = arg.removeprefix("trainer.callbacks=[").removesuffix("]")
            both = f"{listed},{entry}" if listed.strip() else entry
            return [*args[:i], f"trainer.callbacks=[{both}]", *args[i + 1 :]]
    return [*args, override(spec)]


class Fault:
    def __init__(self, spec: str):
        kind, rank, step, *once = spec.split(":", 3)
        self.kind, self.rank, self.step = kind, int(rank), int(step)
        self.once = once[0] if once else None
        if kind in ("freeze", "partition"):
            self.freeze_s, self.once = float(once[0]), None
        if kind == "wait":  # the file is what it waits for, not a once-file
            self.wait_for, self.once = once[0], None
        self._poison = None

    def fires(self, trainer, step: int) -> bool:
        if trainer.info.rank != self.rank or self.step != step:
            return False
        if self.once is not None:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return False
        return True

    def on_step_start(self, trainer, step: int) -> None:
        if not self.fires(trainer, step):
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step} (tests.faults.Fault)")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "sigterm":  # as SLURM would: to the launcher, which forwards it
            launcher = multiprocessing.parent_process()  # None under torchrun: its agent
            os.kill(launcher.pid if launcher else os.getppid(), signal.SIGTERM)
            # Wait for the forwarded signal, so that where the ranks stop does not depend on how
            # fast the launcher relays it (a tiny job can otherwise end first).
            deadline = time.monotonic() + 10.0
            while not stop.signalled() and time.monotonic() < deadline:
                time.sleep(0.001)
        if self.kind == "wait":
            deadline = time.monotonic() + 120.0
            while not os.path.exists(self.wait_for) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.kind in ("freeze", "partition"):
            self._hold_next_round(trainer)
        if self.kind == "sever":
            self._sever(trainer.sync.averager)
        if self.kind == "nan":
            self._poison = trainer.model.register_forward_hook(lambda m, i, out: out * float("nan"))
        if self.kind == "desync":
            self._poison = True

    def _hold_next_round(self, trainer) -> None:
        # a torchft round's first collective, or (asynchronous rounds) the next exchange with
        # the syncer: its messages, which run beside the training where they are in flight
        driver = trainer.sync.driver
        averager = getattr(trainer.sync, "averager", None)
        if hasattr(driver, "rounds"):
            target, name = driver.rounds.comm, "_allreduce"
        elif getattr(averager, "delay", 0):
            target, name = averager, "_messages"
        else:
            target, name = averager, "_talk"
        real = getattr(target, name)

        def frozen_first(*args, **kwargs):
            setattr(target, name, real)  # once
            pid, seconds = os.getpid(), self.freeze_s
            if self.kind == "partition":  # sleeping releases the GIL: the heartbeats go on
                time.sleep(seconds)
                return real(*args, **kwargs)
            helper = subprocess.Popen(
                ["sh", "-c", f"kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"],
                start_new_session=True,
            )
            # stopped in here (or just before): the helper exits right after it wakes us
            helper.wait(timeout=seconds + 60)
            return real(*args, **kwargs)

        setattr(target, name, frozen_first)

    def _sever(self, averager) -> None:
        link = averager.link
        real = link.send

        def broken(*args, **kwargs):
            link.send = real  # once: the next session's link is a new one anyway
            raise RuntimeError("connection severed (tests.faults)")

        link.send = broken

    def on_step_end(self, trainer, step: int) -> None:
        if self._poison is None:
            return
        if self.kind == "desync":
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] += 1e-3
        else:
            self._poison.remove()
        self._poison = None


class Arrival:
    """Writes `marks` when a worker process builds its callbacks after `after` exists: a
    worker restarted after a fault whose once-file is `after` says it is back, before it asks
    for its first torchft round (a `wait` fault of a live group waits for `marks`)."""

    def __init__(self, after: str, marks: str):
        if os.path.exists(after):
            with open(marks, "a"):
                pass


class Snapshot:
    """Saves, at the first step it sees, each rank's model, optimizer, averager and sampler state
    to `DIR/rank-R.pt`: what a resumed run starts from."""

    def __init__(self, dir: str):
        self.dir = dir
        self.done = False

    def on_step_start(self, trainer, step: int) -> None:
        if self.done:
            return
        self.done = True
        state = {
            "step": step,
            "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "averager": trainer.sync.averager.state_dict(),
            "sampler": trainer.batches.state_dict(),
        }
        os.makedirs(self.dir, exist_ok=True)
        torch.save(state, os.path.join(self.dir, f"rank-{trainer.info.rank}.pt"))


class FinalDigest:
    """Writes, after the last step, the SHA-256 of this worker's model to `DIR/rank-R.txt`: the
    replicas right after the final sync, compared across workers (a worker the run ended
    without writes nothing)."""

    def __init__(self, dir: str):
        self.dir = dir

    def on_step_start(self, trainer, step: int) -> None:
        pass

    def on_step_end(self, trainer, step: int) -> None:
        if step != trainer.cfg.trainer.max_steps - 1 or getattr(
            trainer.sync.averager, "stopped", False
        ):
            return
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"rank-{trainer.info.rank}.txt"), "w") as f:
            f.write(digest(trainer.model.state_dict()))


def digest(state: dict) -> str:
    """The SHA-256 of a state dict's tensors, in key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(
            state[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return h.hexdigest()

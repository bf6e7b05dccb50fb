"""Averaging across replica groups through torchft's Manager: workers may die and rejoin.

Each sync is one torchft *round*:

1. `manager.start_quorum()` (with `use_async_quorum=False`, so the quorum and any heal happen
   here): the live replica groups agree on a quorum, and a replica that is behind (restarted, or
   rolled back while the others committed) loads a live peer's state;
2. a one-element all-reduce counts the live participants (a replica that healed in this round
   holds a copy of a peer's state: it contributes zeros and is not counted, so the average is
   over the live replicas' own progress). It is also the barrier after which the peer that
   serves its state may modify it (the HTTP transport serves the tensors by reference);
3. the averager's reducer runs as usual; every `comm.mean_` is one `manager.allreduce` (SUM)
   of the flat buffer, divided exactly as the plain `Communicator` divides (see
   `TorchftCommunicator`), so with no fault the result is bit-identical to the
   torch.distributed path;
4. `manager.should_commit()`. On True the state is the new global state (snapshot kept); on
   False every tensor the round touched is rolled back to the snapshot of the last commit
   (never a half-average) and the average is retried at the next sync.

A quorum that cannot form (fewer than the lighthouse's `min_replicas` live replica groups for the
quorum timeout) is a round that failed the same way: rolled back, counted in `failed_syncs`, and
`quorum_lost` says why, so that the owner can stop with a checkpoint of the last global state
rather than wait forever.

torchft is imported only by the functions here that need it, never at module import, so a run
without fault tolerance never imports it. Nothing here imports Hydra or wandb.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from localsgd.averaging.torchft_comm import QuorumLost, TorchftCommunicator, _sum_then_divide
from localsgd.averaging.torchft_services import make_manager, start_lighthouse

__all__ = [
    "FaultTolerantAverager",
    "QuorumLost",
    "ReplicaGroupsDiverged",
    "TorchftCommunicator",
    "attach",
    "make_manager",
    "start_lighthouse",
]

FT_STATE_KEY = "localsgd_ft"  # our entry in the Manager's state dict


class ReplicaGroupsDiverged(RuntimeError):
    """`check_replicas`: the replica groups do not hold the same weights after an average."""


# --- the round driver around an averager -----------------------------------------------------


def _clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tree(v) for v in value)
    return value


def attach(averager, comm: TorchftCommunicator) -> None:
    """Make `comm` the widest level of `averager`, sharing its counters; a stop-gap until the
    averagers take `comm=`. Only the widest level goes across replica groups: a hierarchical
    averager's inner levels (even one spanning the whole replica group, the same communicator
    as the widest's) stay inside the group, on torch.distributed."""
    old = averager.comm
    if averager.levels[-1] is not old:
        raise ValueError("the averager's widest level is not its communicator")
    if comm.local is None and old.size > 1:
        comm.local = old
        comm.sum_first = _sum_then_divide(old)
    comm.stats = averager.stats
    averager.levels = [*averager.levels[:-1], comm]
    averager.comm = comm


class FaultTolerantAverager:
    """Drives an averager's widest-level averages as torchft rounds, with rollback and heal.

    `averager` is a `PeriodicAverager`, `OuterAverager` or `HierarchicalAverager` (built on the
    replica group's own process group; its widest level is replaced by `comm`); `gradients`, an
    optional `GradientAverager` for a synchronous warmup (its communicator is replaced too).

    The owner calls `start()` once before training (the first quorum; a restarted replica heals
    there and finishes the round its peers are in), then `maybe_average()` instead of
    `averager.maybe_average()` after every optimizer step, and `all_reduce_gradients()` instead
    of `gradients.all_reduce()` during the warmup (skip the optimizer step when it returns
    False). `register_state(key, state_dict, load_state_dict)` adds what a healing replica must
    receive besides the averager (model with integer buffers, optimizer, sampler, RNG, the
    owner's counters); the averager's own state and the flat buffers are sent already.
    `track(state_dict, load_state_dict)` adds state that a failed round must roll back.
    `check_replicas=True` verifies inside every round that averaged every replica that all
    replica groups hold bit-identical `averager.common_tensors()` (ReplicaGroupsDiverged otherwise).
    """

    def __init__(
        self, averager, comm: TorchftCommunicator, *, gradients=None, check_replicas=False
    ):
        if averager.reducer.delays:
            raise ValueError("overlap (delayed averaging) cannot run through torchft")
        self.averager = averager
        self.comm = comm
        self.manager = comm.manager
        attach(averager, comm)
        self.gradients = gradients
        if gradients is not None:
            gradients.comm = comm
            gradients.stats = comm.stats
        self.failed_syncs = 0  # rounds rolled back (the same on every replica)
        self.heals = 0  # times this replica loaded a live peer's state
        self.heals_seen = 0  # heals of any replica, counted alike by every replica
        self.check_replicas = check_replicas
        self.replica_checks = 0  # rounds checked bit-identical across replica groups
        # Streaming DiLoCo: a round is one fragment's sync, and a failed one is undone (the
        # state before the round restored, on every replica) rather than rolled back to the
        # last commit, which would drop the other fragments' local progress
        self.undo = hasattr(averager, "launching")
        self.participants_min = comm.participants
        self.phase = "start"  # the round this replica is in (sent to a healing peer)
        self.tracked: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []
        self.committed: dict | None = None
        self.just_committed = False  # a round committed since the owner last looked
        self.leads = False  # this replica group ranked first in the last committed round
        self.checkpoint_mark = 0  # the owner's schedule of checkpoints (sent to healers)
        self.quorum_lost: str | None = None  # why the last round found no quorum
        self._open: dict | None = None  # tau > 0: the state before the round in flight
        self._peer: dict | None = None
        self._snapshot_due = False
        self.manager.register_state_dict_fn(FT_STATE_KEY, self._load_ft_state, self._ft_state)

    # --- state ---------------------------------------------------------------------------------

    @property
    def participants(self) -> int:
        return self.comm.participants

    def register_state(
        self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """What a healing replica receives besides the averager; loaded in registration
        order, after the averager's state and flat buffers."""
        self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def track(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]):
        """State a failed round rolls back too (e.g. optimizer state averaged by a hook)."""
        self.tracked.append((state_dict, load_state_dict))

    def _snapshot(self) -> dict:
        av = self.averager
        av.ensure_bound()
        return {
            "buffers": [b.detach().clone() for b in av.flat.buffers],
            "reducer": _clone_tree(av.reducer.state_dict()),
            "tracked": [_clone_tree(fn()) for fn, _ in self.tracked],
        }

    def _restore(self, snap: dict) -> None:
        av = self.averager
        av.ensure_bound()
        for mine, saved in zip(av.flat.buffers, snap["buffers"], strict=True):
            mine.copy_(saved)
        av.reducer.load_state_dict(_clone_tree(snap["reducer"]))
        for (_, load), saved in zip(self.tracked, snap["tracked"], strict=True):
            load(_clone_tree(saved))

    def _ft_state(self) -> dict:
        # served by reference until every healer has loaded it (the count all-reduce in
        # begin() is the barrier), so no clones are needed beyond those state_dict() makes
        av = self.averager
        av.ensure_bound()
        return {
            "phase": self.phase,
            "averager": av.state_dict(),
            "buffers": list(av.flat.buffers),
            "committed": self.committed,
            "failed_syncs": self.failed_syncs,
            "participants_min": self.participants_min,
            "heals_seen": self.heals_seen,
            "checkpoint_mark": self.checkpoint_mark,
        }

    def _load_ft_state(self, state: dict) -> None:
        av = self.averager
        av.ensure_bound()
        av.load_state_dict(state["averager"])
        for mine, theirs in zip(av.flat.buffers, state["buffers"], strict=True):
            mine.copy_(theirs)
        self.committed = _clone_tree(state["committed"])
        self.failed_syncs = int(state["failed_syncs"])
        self.participants_min = min(self.participants_min, int(state["participants_min"]))
        self.heals_seen = int(state["heals_seen"])
        self.checkpoint_mark = int(state["checkpoint_mark"])
        self._peer = {"phase": state["phase"]}
        self.comm.healed = True

    def state_dict(self) -> dict:
        """The counters, for the owner's checkpoint."""
        return {
            "failed_syncs": self.failed_syncs,
            "heals": self.heals,
            "heals_seen": self.heals_seen,
            "participants_min": self.participants_min,
        }

    def load_state_dict(self, state: dict) -> None:
        self.failed_syncs = int(state["failed_syncs"])
        self.heals = int(state["heals"])
        self.heals_seen = int(state.get("heals_seen", 0))
        self.participants_min = int(state["participants_min"])

    def _verify(self) -> None:
        """Inside a round that brought the replica groups together (every replica in sync, or
        a merge: Streaming DiLoCo's fragments, a mixed merge, eager steps), check what every
        group must hold identically now: `averager.common_tensors()`."""
        av = self.averager
        if not self.check_replicas or not (av.all_in_sync or av.merged):
            return
        self._check(av.common_tensors(), f"after the average at step {av.step - 1}")

    def _verify_gradients(self) -> None:
        """A warmup round: the parameters and the averaged gradients, so that the step the
        round is for leaves every group with the same parameters."""
        if self.check_replicas:
            grads = self.gradients
            self._check([*grads.params, *grads.buffers], f"in the warmup step {self.averager.step}")

    def _check(self, tensors: list[torch.Tensor], when: str) -> None:
        self.replica_checks += 1
        if not self.comm.identical(tensors):
            raise ReplicaGroupsDiverged(f"replica groups differ {when}")

    # --- rounds --------------------------------------------------------------------------------

    def _round(self, phase: str, body: Callable[[], Any]) -> bool:
        before = self._snapshot() if self.undo and phase != "grad" else None
        self.phase = phase
        try:
            if self.comm.begin():
                self.heals += 1  # behind its peers (rolled back while they committed)
            self.heals_seen += self.comm.healers
        except QuorumLost as e:
            self.quorum_lost = str(e)
        body()  # with no quorum: the counters advance, nothing is sent, the round rolls back
        self._settle()
        self._verify_gradients() if phase == "grad" else self._verify()
        ok = self.comm.commit()
        self.just_committed = ok
        if ok:
            self.leads = self.manager.participating_rank() == 0
            self.participants_min = min(self.participants_min, self.comm.participants)
            if phase != "grad" and not self.undo:
                self.committed = self._snapshot()
            elif phase == "grad":
                self._snapshot_due = True
        else:
            self.failed_syncs += 1
            if before is not None:
                self._restore(before)
            elif phase != "grad" and self.committed is not None:
                self._restore(self.committed)
        self.phase = "idle"
        return ok

    def start(self, wait_for: int = 1, timeout_s: float = 120.0) -> str:
        """The first round, before training. A fresh replica repeats empty rounds until a
        quorum holds `wait_for` replica groups (give W: nobody trains alone while the others
        still start; the lighthouse's own `min_replicas` is the steady-state minimum) and
        returns "fresh". A restarted replica (behind its peers) heals from a live peer in the
        first quorum, finishes the round that peer is in and returns that round's phase:
        "sync" (a scheduled average, inside the peer's `maybe_average`), "average" (an average
        outside the schedule, e.g. the final one) or "grad" (a warmup gradient round: the
        owner must still take that step's optimizer step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.phase = "start"
            self._peer = None
            healed = self.comm.begin()
            phase = self._peer["phase"] if healed and self._peer else "start"
            # a late fresh replica gets its peers' start state: not counted as a heal
            healed = healed and phase != "start"
            self.heals += healed
            if phase != "start":
                self.heals_seen += self.comm.healers
            before = self._snapshot() if self.undo and phase in ("sync", "average") else None
            if phase == "sync":
                self.averager.maybe_average()
            elif phase == "average":
                self.averager.average()
            elif phase == "grad" and self.gradients is not None:
                self.gradients.all_reduce()
            self._settle()
            if phase in ("sync", "average"):
                self._verify()
            ok = self.comm.commit()
            self.phase = "idle"
            if ok and not healed and self.manager.num_participants() < wait_for:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"torchft: {self.manager.num_participants()} of {wait_for} replica "
                        f"groups joined within {timeout_s:g} s"
                    )
                time.sleep(0.05)
                continue
            if ok:
                if phase == "grad":
                    self._snapshot_due = True
                elif not self.undo:
                    self.committed = self._snapshot()
                return phase if healed else "fresh"
            self.failed_syncs += 1
            if before is not None:
                self._restore(before)
            elif self.committed is not None:
                self._restore(self.committed)
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft: no committed first round within {timeout_s:g} s")

    def maybe_average(self) -> bool:
        """`averager.maybe_average()`, where a widest-level average is a torchft round.
        Returns whether the averager averaged (a rolled-back round counts as averaged: the
        replicas hold the last global state)."""
        av = self.averager
        if self._snapshot_due and av.step == av.warmup_steps - 1 and not self.undo:
            # the last synchronous warmup step: every replica holds the same weights now
            self.committed = self._snapshot()
            self._snapshot_due = False
        if self.undo and av.delay:
            return self._delayed_round()
        if not self._crosses_groups(av.step):
            return av.maybe_average()
        done = []
        self._round("sync", lambda: done.append(av.maybe_average()))
        return bool(done and done[0])

    def _delayed_round(self) -> bool:
        """Streaming DiLoCo with tau > 0: a round opens at a fragment's launch (the quorum, then
        the all-reduce launched, while tau steps train) and closes at its merge
        (`should_commit()`, then the merge). A failed round merges nothing: the fragment keeps
        its local values and its state (anchor, outer state, residual) from before the launch.
        tau < period/fragments, so no launch or other merge falls inside a round."""
        av = self.averager
        step = av.step
        q = av.merging(step)
        if q is not None and self._open is not None:
            av.frags.wait(q)
            ok = self.comm.commit()
            self.just_committed = ok
            if ok:
                self.leads = self.manager.participating_rank() == 0
                self.participants_min = min(self.participants_min, self.comm.participants)
            else:
                self.failed_syncs += 1
                av.reducer.load_state_dict(_clone_tree(self._open["reducer"]))
            self._open = None
            self.phase = "idle"
            return av.maybe_average()
        if av.launching(step) is None:
            return av.maybe_average()
        self.phase = "sync"
        try:
            if self.comm.begin():
                self.heals += 1
            self.heals_seen += self.comm.healers
        except QuorumLost as e:
            self.quorum_lost = str(e)
        self._open = self._snapshot()
        return av.maybe_average()  # launches the fragment's exchange

    def _settle(self) -> None:
        """Finish, inside the round, what the round launched: torchft reconfigures its process
        group at every quorum, so no collective may outlive its round (the eager outer step's
        exchange, which would otherwise be received a round later, is received now and used
        then: the same values). A delayed merge's round closes at the merge instead."""
        av = self.averager
        if self.undo and not av.delay:
            for p in range(av.fragments):
                av.frags.wait(p)

    def _crosses_groups(self, step: int) -> bool:
        """Whether the averager's update after `step` averages across replica groups (its
        widest level): a round. For Streaming DiLoCo (tau = 0): a fragment's sync."""
        if self.undo:
            return self.averager.launching(step) is not None
        return self.averager.averages_all(step)

    def average(self) -> bool:
        """An average outside the schedule (e.g. before the final evaluation), as a round."""
        return self._round("average", self.averager.average)

    def all_reduce_gradients(self) -> bool:
        """The warmup's gradient average as a round; False: the gradients are not valid on
        this replica, skip this optimizer step."""
        if self.gradients is None:
            raise ValueError("FaultTolerantAverager(gradients=...) was not given")
        return self._round("grad", self.gradients.all_reduce)

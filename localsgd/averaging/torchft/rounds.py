"""Averaging across replica groups through torchft's Manager: workers may die and rejoin.

`FaultTolerantRounds` runs each sync across replica groups as one torchft *round*:

1. `manager.start_quorum()` (with `use_async_quorum=False`, so the quorum and any heal happen
   here): the live replica groups agree on a quorum, and a replica that is behind (restarted, or
   rolled back while the others committed) loads a live peer's state;
2. a small all-reduce counts the live participants (a replica that healed in this round holds a
   copy of a peer's state: it contributes zeros and is not counted, so the average is over the
   live replicas' own progress) and carries any replica's request to stop (SIGTERM), so that
   every replica learns it in the same round. It is also the barrier after which the peer that
   serves its state may modify it (the HTTP transport serves the tensors by reference);
3. the averager's rounds run as usual; every `comm.mean_` is one `manager.allreduce` (SUM)
   of the flat buffer, divided exactly as the plain `Communicator` divides (see
   `TorchftCommunicator`), so with no fault the result is bit-identical to the
   torch.distributed path;
4. `manager.should_commit()`. On True the state is the new global state; on False it is put
   back (never a half-average): to the last committed round's state where an average replaces
   the whole model, or to the state from before the round where it touches a part of it
   (Streaming DiLoCo's fragments: `Averager.failed_round_restores`). The sync is retried at
   the next one, or, with `retry_failed`, at once: from each replica's state before it, as a
   round of its own with the next quorum (`maybe_average`).

The averager says what a step is (`Averager.sync_at`): a blocking sync is one round; a delayed
one (Streaming DiLoCo, τ > 0) is a round that opens at the launch and closes at the merge.

A quorum that cannot form (fewer than the lighthouse's `min_replicas` live replica groups for the
quorum timeout) is a round that failed the same way: put back, counted in `failed_syncs`, and
`quorum_lost` says why, so that the owner can stop with a checkpoint of the last global state
rather than wait forever.

torchft is imported only by the functions that need it, never at module import, so a run
without fault tolerance never imports it. Nothing here imports Hydra or wandb.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from localsgd.averaging.torchft.comm import QuorumLost, TorchftCommunicator, _sum_then_divide
from localsgd.averaging.trees import clone_tree

FT_STATE_KEY = "localsgd_ft"  # our entry in the Manager's state dict


class ReplicaGroupsDiverged(RuntimeError):
    """`check_replicas`: the replica groups do not hold the same weights after an average."""


def without_residuals(averager_state: dict) -> dict:
    """An averager's state with its error-feedback residuals taken out (the rounds then load
    zeros): a worker's residual is what it failed to send, its own, never a peer's."""
    rounds = averager_state.get("rounds", {})
    if rounds.get("residuals") is None:
        return averager_state
    return {**averager_state, "rounds": {**rounds, "residuals": None}}


def attach(averager, comm: TorchftCommunicator) -> None:
    """Make `comm` the widest level of `averager`, sharing its counters. Only the widest level
    goes across replica groups: a hierarchical averager's inner levels (even one spanning the
    whole replica group, the same communicator as the widest's) stay inside the group, on
    torch.distributed."""
    old = averager.comm
    if averager.levels[-1] is not old:
        raise ValueError("the averager's widest level is not its communicator")
    if comm.local is None and old.size > 1:
        comm.local = old
        comm.sum_first = _sum_then_divide(old)
    comm.stats = averager.stats
    averager.levels = [*averager.levels[:-1], comm]
    averager.comm = comm


class FaultTolerantRounds:
    """Runs an averager's syncs across replica groups as torchft rounds, with rollback and heal.

    `averager`: any of the averagers here (built
    on the replica group's own process group; its widest level is replaced by `comm`);
    `gradients`, an optional `GradientAverager` for a synchronous warmup (its communicator is
    replaced too); `stop_requested`, a callable saying whether this replica was asked to stop
    (then every replica agrees, in the next round, to stop after it: `stop_agreed`).

    The owner calls `start()` once before training (the first quorum; a restarted replica heals
    there and finishes the round its peers are in), then `maybe_average()` instead of
    `averager.maybe_average()` after every optimizer step, and `all_reduce_gradients()` instead
    of `gradients.all_reduce()` during the warmup (skip the optimizer step when it returns
    False). `register_state(key, state_dict, load_state_dict)` adds what a healing replica must
    receive besides the averager (model buffers, optimizer, sampler, the owner's counters); the
    averager's own state and the flat buffers are sent already, less the error-feedback
    residuals (a healer starts with none: its own died with it). `check_replicas=True` verifies
    inside every round that brought the groups together that they hold bit-identical
    `averager.common_tensors()` (ReplicaGroupsDiverged otherwise); `replica_checks` counts them.
    """

    def __init__(
        self,
        averager,
        comm: TorchftCommunicator,
        *,
        gradients=None,
        check_replicas: bool = False,
        stop_requested: Callable[[], bool] | None = None,
        samples_per_step: int = 0,
        retry_failed: bool = False,
    ):
        if averager.rounds_overlap:
            raise ValueError(
                "delay_steps must be < period/fragments through torchft (a round must close "
                "before the next fragment's opens)"
            )
        self.averager = averager
        self.comm = comm
        self.manager = comm.manager
        attach(averager, comm)
        self.gradients = gradients
        if gradients is not None:
            gradients.comm = comm
            gradients.stats = comm.stats
        self.stop_requested = stop_requested or (lambda: False)
        self.stop_agreed = False  # a replica asked to stop: every replica stops after this round
        # what one optimizer step of this replica group trains on; `stepped()` counts them into
        # the next round, whose commit adds every live replica's to `merged_samples`
        self.samples_per_step = samples_per_step
        self.pending_samples = 0
        self.failed_syncs = 0  # rounds rolled back (the same on every replica)
        self.heals = 0  # times this replica loaded a live peer's state
        self.heals_seen = 0  # heals of any replica, counted alike by every replica
        self.check_replicas = check_replicas
        self.replica_checks = 0  # rounds checked bit-identical across replica groups
        self.undo = averager.failed_round_restores == "round"
        # a failed sync retried at once from this replica's state before it, with the next
        # quorum (`maybe_average`); only where a sync replaces the whole model
        self.retry_failed = retry_failed and not self.undo
        self.retried = 0  # failed syncs retried at once that then committed
        self._round_samples = 0  # what the last round's count carried of this replica's
        self.participants_min = comm.participants
        self.phase = "start"  # the round this replica is in (sent to a healing peer)
        self.committed: dict | None = None  # the last committed state ("commit" rollback)
        self.just_committed = False  # a round committed since the owner last looked
        self.leads = False  # this replica group ranked first in the last committed round
        self.checkpoint_mark = 0  # the owner's schedule of checkpoints (sent to healers)
        self.quorum_lost: str | None = None  # why the last round found no quorum
        self._open_rounds: dict | None = None  # τ > 0: the rounds' state before the launch
        self._peer: dict | None = None
        self._snapshot_due = False
        # called with each round's outcome as it closes (True: committed): what a round
        # measured beside its average (the drift) counts only if the round committed
        self.round_ended: list[Callable[[bool], None]] = []
        self.manager.register_state_dict_fn(FT_STATE_KEY, self._load_ft_state, self._ft_state)

    # --- state ---------------------------------------------------------------------------------

    @property
    def participants(self) -> int:
        return self.comm.participants

    @property
    def merged_samples(self) -> int:
        """Samples whose training reached a committed global state, over every replica group:
        a rolled-back round's, a dead or frozen replica's since its last round, a healed one's
        own are not (the goodput a chaos run keeps; `experiments/chaos/chaos_study.py`)."""
        return self.comm.merged_samples

    def stepped(self) -> None:
        """The owner took (or, in the warmup, is about to take) one optimizer step."""
        self.pending_samples += self.samples_per_step

    def register_state(
        self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """What a healing replica receives besides the averager; loaded in registration
        order, after the averager's state and flat buffers."""
        self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def _hooks_state(self) -> list:
        """What each of the averager's hooks that keeps state (optimizer state averaging) holds
        before a round: its tensors and its clock."""
        return [
            (h.snapshot(), h.state_dict()) for h in self.averager.hooks if hasattr(h, "snapshot")
        ]

    def _put_hooks_back(self, saved: list) -> None:
        hooks = [h for h in self.averager.hooks if hasattr(h, "snapshot")]
        for hook, (tensors, state) in zip(hooks, saved, strict=True):
            hook.restore(tensors)
            hook.load_state_dict(state)

    def _snapshot(self) -> dict:
        av = self.averager
        av.ensure_bound()
        return {
            # mirror mode (sharded) between steps: the values live in the tensors
            "buffers": [b.detach().clone() for b in av.flat.current()],
            "rounds": clone_tree(av.rounds.state_dict()),
            "rule": clone_tree(av.rule_state()),  # an adaptive period's
            "samples": av.part_samples.state_dict(),  # weighted rounds' counts
        }

    def _restore(self, snap: dict) -> None:
        av = self.averager
        av.ensure_bound()
        av.flat.assign(snap["buffers"])
        av.rounds.load_state_dict(clone_tree(snap["rounds"]))
        av.load_rule_state(clone_tree(snap.get("rule", {})))
        if "samples" in snap:
            av.part_samples.load_state_dict(snap["samples"])

    def _ft_state(self) -> dict:
        # served by reference until every healer has loaded it (the count all-reduce in
        # begin() is the barrier), so no clones are needed beyond those state_dict() makes
        av = self.averager
        av.ensure_bound()
        return {
            "phase": self.phase,
            "averager": av.state_dict(),
            "buffers": list(av.flat.current()),
            "committed": self.committed,
            "failed_syncs": self.failed_syncs,
            "participants_min": self.participants_min,
            "heals_seen": self.heals_seen,
            "checkpoint_mark": self.checkpoint_mark,
            "merged_samples": self.comm.merged_samples,
            "retried": self.retried,
        }

    def _load_ft_state(self, state: dict) -> None:
        av = self.averager
        av.ensure_bound()
        av.load_state_dict(without_residuals(state["averager"]))
        av.flat.assign(state["buffers"])
        committed = state["committed"]
        if committed is not None:  # the peer's residuals are not this replica's
            committed = {**committed, "rounds": without_residuals(
                {"rounds": committed["rounds"]})["rounds"]}  # fmt: skip
        self.committed = clone_tree(committed)
        self.failed_syncs = int(state["failed_syncs"])
        self.participants_min = min(self.participants_min, int(state["participants_min"]))
        self.heals_seen = int(state["heals_seen"])
        self.checkpoint_mark = int(state["checkpoint_mark"])
        self.comm.merged_samples = int(state.get("merged_samples", 0))
        self.retried = int(state.get("retried", 0))  # counted alike by every worker, as syncs
        self._peer = {"phase": state["phase"]}
        self.comm.healed = True

    def state_dict(self) -> dict:
        """The counters, for the owner's checkpoint."""
        return {
            "failed_syncs": self.failed_syncs,
            "heals": self.heals,
            "heals_seen": self.heals_seen,
            "participants_min": self.participants_min,
            "merged_samples": self.comm.merged_samples,
            "retried": self.retried,
        }

    def load_state_dict(self, state: dict) -> None:
        self.failed_syncs = int(state["failed_syncs"])
        self.heals = int(state["heals"])
        self.heals_seen = int(state.get("heals_seen", 0))
        self.participants_min = int(state["participants_min"])
        self.comm.merged_samples = int(state.get("merged_samples", 0))
        self.retried = int(state.get("retried", 0))

    # --- the replica check ---------------------------------------------------------------------

    def _verify(self, phase: str) -> None:
        """Inside a round: after an average that brought the groups together (every replica in
        sync, or a merge: Streaming DiLoCo's fragments, a mixed merge, eager steps), what every
        group must hold identically now, `averager.common_tensors()`; in a warmup round the
        parameters and the averaged gradients (so the step leaves every group alike); in the
        round a delayed merge closes, what every group received (`launched_received`), checked
        before the commit, as the merge follows it."""
        if not self.check_replicas:
            return
        av = self.averager
        if phase == "grad":
            tensors = [*self.gradients.params, *self.gradients.buffers]
            when = f"in the warmup step {av.step}"
        elif phase == "merge":  # before the delayed merge: what every group received
            tensors, when = av.launched_received(av.step), f"in the round merged at {av.step}"
        elif av.all_in_sync or av.merged:
            tensors, when = av.common_tensors(), f"after the average at step {av.step - 1}"
        else:
            return
        self.replica_checks += 1
        if not self.comm.identical(tensors):
            raise ReplicaGroupsDiverged(f"replica groups differ {when}")

    # --- rounds --------------------------------------------------------------------------------

    def _begin(self, phase: str) -> bool:
        """Open a round: the quorum (a heal if this replica is behind) and the count, which
        carries this replica's stop request. Returns whether this replica healed."""
        self.phase = phase
        try:
            samples, self.pending_samples = self.pending_samples, 0  # kept only if committed
            self._round_samples = samples
            healed = self.comm.begin(stop=self.stop_requested(), samples=samples)
        except QuorumLost as e:
            self.quorum_lost = str(e)
            return False
        self.heals_seen += self.comm.healers
        self.stop_agreed = self.stop_agreed or self.comm.stop_requested
        return healed

    def _commit(self, joining: bool = False) -> bool:
        """Close a round: `should_commit()` and its bookkeeping (the owner puts back). While
        `joining` (the first round), the groups still arriving are not a loss of participants."""
        ok = self.comm.commit()
        self.just_committed = ok
        if ok:
            self.leads = self.manager.participating_rank() == 0
            if not joining:
                self.participants_min = min(self.participants_min, self.comm.participants)
        else:
            self.failed_syncs += 1
        for ended in self.round_ended:
            ended(ok)
        self.phase = "idle"
        return ok

    def _round(self, phase: str, body: Callable[[], Any]) -> bool:
        before = self._snapshot() if self.undo and phase != "grad" else None
        # what a hook averages in the round (optimizer state) is put back if it fails
        hooks = self._hooks_state() if phase != "grad" else None
        self.heals += self._begin(phase)  # behind its peers (rolled back while they committed)
        body()  # with no quorum: the counters advance, nothing is sent, the round is put back
        self._settle()
        self._verify(phase)
        ok = self._commit()
        if not ok and hooks:
            self._put_hooks_back(hooks)
        if phase == "grad":  # a failed one: the step is skipped, nothing to put back
            self._snapshot_due = self._snapshot_due or ok
        elif ok and not self.undo:
            self.committed = self._snapshot()
        elif not ok:
            self._put_back(before)
        return ok

    def _put_back(self, before: dict | None) -> None:
        if before is not None:
            self._restore(before)
        elif self.committed is not None:
            self._restore(self.committed)

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
            self._peer = None
            healed = self._begin("start")
            if self.quorum_lost is not None:
                why, self.quorum_lost = self.quorum_lost, None
                raise QuorumLost(why)
            phase = self._peer["phase"] if healed and self._peer else "start"
            # a late fresh replica gets its peers' start state: not counted as a heal
            healed = healed and phase != "start"
            self.heals += healed
            if phase == "start":
                self.heals_seen -= self.comm.healers
            before = self._snapshot() if self.undo and phase in ("sync", "average") else None
            self.phase = phase
            if phase == "sync":
                self.averager.maybe_average()
            elif phase == "average":
                self.averager.average()
            elif phase == "grad" and self.gradients is not None:
                self.gradients.all_reduce()
            self._settle()
            if phase != "start":
                self._verify(phase)
            ok = self._commit(joining=phase == "start")
            self.just_committed = False  # the owner's checkpoints start with its steps
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
            self._put_back(before)
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft: no committed first round within {timeout_s:g} s")

    def maybe_average(self) -> bool:
        """`averager.maybe_average()`, where a sync across replica groups is a torchft round.
        Returns whether the averager averaged (a rolled-back round counts as averaged: the
        replicas hold the last global state)."""
        av = self.averager
        if self._snapshot_due and av.step == av.warmup_steps - 1 and not self.undo:
            # the last synchronous warmup step: every replica holds the same weights now
            self.committed = self._snapshot()
            self._snapshot_due = False
        kind = av.sync_at(av.step)
        if kind == "launch":
            # a round from the launch to the merge: a failed one merges nothing, and the
            # fragment keeps its local values and its state (anchor, outer state, residual)
            self.heals += self._begin("sync")
            self._open_rounds = clone_tree(av.rounds.state_dict())
            return av.maybe_average()
        if kind == "merge" and self._open_rounds is not None:
            av.complete_launched()  # the fragment launched a round ago
            self._verify("merge")
            if not self._commit():
                av.rounds.load_state_dict(self._open_rounds)
            self._open_rounds = None
            return av.maybe_average()
        if kind != "sync":
            return av.maybe_average()
        done = []
        local = self._snapshot() if self.retry_failed else None
        ok = self._round("sync", lambda: done.append(av.maybe_average()))
        if not ok and local is not None and self.quorum_lost is None:
            self._retry(local)
        return bool(done and done[0])

    def _retry(self, local: dict) -> None:
        """A sync that failed (a peer died, froze or was cut inside it), retried at once: this
        replica's state from before it back (its training since the last round kept, not rolled
        back to the last global state), and the same average as a round of its own with the
        next quorum, which the lighthouse forms without the failed peer. It is the "average"
        phase a peer that heals in it finishes (`start`). If it fails too, the last global state
        is put back, as without a retry."""
        self.pending_samples += self._round_samples  # counted again, in the retried round
        self._restore(local)
        self._peer = None
        av = self.averager

        def body() -> None:
            # a replica that was behind (its peers committed the sync it failed) heals here,
            # in its peers' next sync: it runs that sync, as they do
            if self.comm.healed and self._peer and self._peer["phase"] == "sync":
                av.maybe_average()
            else:
                av.average()

        if self._round("average", body):
            self.retried += 1

    def _settle(self) -> None:
        """Finish, inside the round, what the round launched: torchft reconfigures its process
        group at every quorum, so no collective may outlive its round (the eager outer step's
        exchange, which would otherwise be received a round later, is received now and used
        then: the same values). A delayed merge's round closes at the merge instead, where
        `maybe_average` completes it."""
        if not self.averager.delayed_syncs:
            self.averager.complete_launched()

    def average(self) -> bool:
        """An average outside the schedule (e.g. before the final evaluation), as a round."""
        return self._round("average", self.averager.average)

    def all_reduce_gradients(self) -> bool:
        """The warmup's gradient average as a round; False: the gradients are not valid on
        this replica, skip this optimizer step."""
        if self.gradients is None:
            raise ValueError("FaultTolerantRounds(gradients=...) was not given")
        return self._round("grad", self.gradients.all_reduce)

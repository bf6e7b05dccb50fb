"""The `Synchroniser`: everything the training loop knows of how replicas are kept together.

It holds the averager (`localsgd.loop.strategies.build_averager`), the synchronous warmup's
gradient averaging, drift measured around the averages that bring every replica together, and,
under `ft=torchft`, the fault tolerance (`localsgd.loop.fault_tolerance`): joining or healing at
the start, checkpoints and stops after committed rounds, which worker writes the results. The
trainer calls the same methods with or without it, and holds no branch of its own for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from localsgd.averaging import Averager, GradientAverager
from localsgd.averaging.flat import local_tensor
from localsgd.loop.drift import DriftMeter
from localsgd.loop.guards import DroppedContributions, check_replicas
from localsgd.loop.metrics import notice
from localsgd.loop.stop import StopAgreement

if TYPE_CHECKING:
    from localsgd.loop.fault_tolerance import FaultTolerance
    from localsgd.loop.sharding import Sharding


class Synchroniser:
    """How the workers' replicas are kept together, as the training loop calls it.

    Before the first step the loop calls `start` (under torchft the first round: a restarted
    worker heals there). Around each optimizer step it calls `zero_grad`, `after_backward` (the
    warmup's gradient all-reduce; returns whether to step) and `after_step` (the model average
    when the schedule says), then `checkpoint` (when due, or at an agreed stop). Between them it
    asks `in_sync` / `merged` (whether the replicas, or what they received, are identical now),
    `next_sync` and `common_tensors`; at the end `finish`, `writes_results` and `summary`.
    """

    def __init__(
        self,
        averager: Averager,
        model: torch.nn.Module,
        max_steps: int,
        grad_averager: GradientAverager | None = None,
        drift: DriftMeter | None = None,
        verify: bool = False,
        group: dist.ProcessGroup | None = None,
        sharding: Sharding | None = None,
    ):
        self.averager = averager
        self.sharding = sharding if sharding is not None and sharding.sharded else None
        self.group = group  # the replicas held alike (sharded replica groups: one shard's)
        self.verify = verify  # check after each sync that the replicas are bit-identical
        self.replica_checks = 0
        self.model = model
        self.max_steps = max_steps
        self.grad_averager = grad_averager
        self.drift = drift
        if drift is not None:
            averager.global_hooks.append(drift)
        self.stats = averager.stats  # every collective's counters, the warmup's included
        self.in_sync = True  # the replicas are identical right now
        self.synchronous = False  # the step being taken belongs to the synchronous warmup
        # ft=torchft: the syncs (and the warmup's gradient averages) as torchft rounds; None:
        # straight through torch.distributed
        self.fault_tolerance: FaultTolerance | None = None
        self.announced = 0  # trust events announced so far (`_announce_trust`)
        # contributions an all-reduce left out for holding NaN/Inf (`averaging.finite`)
        self.dropped_nonfinite = DroppedContributions(averager.dropped_at)

    @property
    def _driver(self):
        """What runs the averages: the averager, or its torchft rounds."""
        ft = self.fault_tolerance
        return self.averager if ft is None else ft.rounds

    @property
    def warmup_steps(self) -> int:
        return self.averager.warmup_steps

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step is synchronous (gradients averaged)."""
        return self.averager.in_warmup

    @property
    def merged(self) -> bool:
        """With a delayed average: the last step applied one (what every rank received is
        identical; the replicas differ by their local progress since it was launched)."""
        return self.averager.merged

    # --- the start -------------------------------------------------------------------------------

    def start(
        self,
        registry: Mapping[str, Any],
        optimizer_step: Callable[[], None],
        current_step: Callable[[], int],
        every: int,
    ) -> int:
        """Before the first step (after any resume): under torchft the first round. A
        restarted worker heals there from a live peer (the heal set: `registry`, the trainer's
        checkpointed state, whose loop state carries the step) and finishes the round that peer
        is in (`optimizer_step` takes a warmup step's optimizer step). Returns how many steps
        that round completed (0 or 1) beyond `current_step()`."""
        ft = self.fault_tolerance
        if ft is None:
            return 0
        phase = ft.join(registry, optimizer_step, current_step(), every)
        if phase == "fresh":
            return 0
        done = 0
        if phase == "grad":  # the peer is inside the warmup step's gradient average
            self.synchronous = True
            self.after_step(None)
            done = 1
        elif phase == "sync":  # inside the peer's after_step: the average of step `step`
            self.in_sync = self.averager.all_in_sync
            done = 1
        else:  # "average": the final average, after the last step
            self.in_sync = True
        notice(
            f"ft: worker {ft.info.rank} healed from a live peer; it trains on from step "
            f"{current_step() + done}"
        )
        return done

    # --- each step -------------------------------------------------------------------------------

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        # In the warmup the gradients are views of GradientAverager's flat buffer: zero them in
        # place. Afterwards drop them: zeroing and then accumulating into old gradients costs two
        # extra passes over the model per step (~10% of a step for a 10M MLP on CPU).
        optimizer.zero_grad(set_to_none=not self.in_warmup)

    def after_backward(self, skip: bool) -> bool:
        """The gradients are ready (zeroed if `skip`, a non-finite loss under nan_policy=skip).
        In the warmup they are averaged: plain mini-batch SGD. Returns whether to step: a
        skipping rank still steps in the warmup (on the others' gradients), or replicas split.
        Under torchft a failed round returns False: every replica skips the step."""
        self.synchronous = self.in_warmup
        if self.fault_tolerance is not None and not skip:  # counted into the next round
            self.fault_tolerance.rounds.stepped()
        if not self.synchronous:
            return not skip
        if self.fault_tolerance is not None:
            return self.fault_tolerance.rounds.all_reduce_gradients()
        self.grad_averager.all_reduce()
        return True

    def after_step(self, loss: torch.Tensor | None) -> None:
        """After the optimizer step: feed the loss (None: the step was skipped) to a schedule
        that adapts to it, then average when the schedule says."""
        if loss is not None and self.averager.needs_loss:
            # sharded: the replica group's loss, or each shard index would adapt its own way
            shards = self.sharding
            self.averager.observe_loss(loss if shards is None else shards.group_mean(loss))
        self._driver.maybe_average()
        self.in_sync = self.synchronous or self.averager.all_in_sync
        self._collect_dropped(self.averager.step - 1)
        self._announce_trust()

    def _collect_dropped(self, step: int) -> None:
        comms = [*self.averager.levels]
        if self.grad_averager is not None:  # the warmup's gradients left out (guarded, robust)
            comms.append(self.grad_averager.comm)
        if self.fault_tolerance is not None:
            comms.append(self.fault_tolerance.rounds.comm)
        self.dropped_nonfinite.collect(comms, step)

    def _announce_trust(self) -> None:
        """Rank 0 (under torchft, the replica that led the last committed round) names each
        dropped contribution and excluded worker, once (every rank holds the same events)."""
        trust = self.trust
        if trust is None or len(trust.events) == self.announced:
            return
        fresh, self.announced = trust.events[self.announced :], len(trust.events)
        ft = self.fault_tolerance
        if ft is not None:
            speaks = ft.rounds.leads
        else:
            speaks = not dist.is_initialized() or dist.get_rank() == 0
        if speaks:
            for line in trust.lines(fresh):
                notice(line)

    def next_sync(self, step: int) -> int | None:
        """The first step index >= `step` after which the replicas are together again (a warmup
        step, or an average over every rank), or None if none is left."""
        nxt = step if step < self.warmup_steps else self.averager.next_sync(step)
        return nxt if nxt is not None and nxt < self.max_steps else None

    def common_tensors(self, step: int) -> list[torch.Tensor]:
        """What every rank holds identically after step `step`, which was a sync."""
        if step < self.warmup_steps:
            # the warmup keeps only the parameters identical (BatchNorm statistics stay local
            # until the first average); sharded, this rank's shards of them
            return [local_tensor(p) for p in self.model.parameters()]
        return self.averager.common_tensors()

    def check_replicas(self, step: int, rank: int) -> None:
        """With `sync.check_replicas`: fail unless every rank holds the same `common_tensors`
        after step `step`, a sync (one gather; off by default)."""
        if self.verify and self.fault_tolerance is None:  # under torchft: inside each round
            check_replicas(self.common_tensors(step), step, rank, self.group)
            self.replica_checks += 1

    @property
    def checks_done(self) -> int:
        """Syncs checked bit-identical so far (`sync.check_replicas`): the summary reports it,
        so that a mode the check would skip cannot pass for a checked one."""
        ft = self.fault_tolerance
        return ft.rounds.replica_checks if ft is not None else self.replica_checks

    # --- checkpoints and the end -----------------------------------------------------------------

    def checkpoint(
        self,
        step: int,
        every: int,
        stop: StopAgreement,
        save: Callable[[bool], str],
        final: bool = False,
    ) -> bool:
        """After step `step` (`final`: after the final average): checkpoint when due (every
        `every` steps and at the end) or at an agreed stop; True to stop the run there.
        `save(shared, writes=True)` writes: every rank its own state, or (`shared`, under
        torchft) the one state every replica holds, by the worker that leads (`writes`)."""
        ft = self.fault_tolerance
        if ft is not None:
            rounds = ft.rounds
            if rounds.quorum_lost is not None and not rounds.undo:
                self.in_sync = True  # rolled back: every worker holds the last global state
            if rounds.stop_agreed and rounds.just_committed and not self.in_sync and not final:
                # Streaming DiLoCo's workers are never all in sync: one blocking average (a
                # round: it commits, or the stop waits for the next) leaves a state to resume
                self.in_sync = self._driver.average()
            return ft.checkpoint(
                step,
                final or step >= self.max_steps,
                every,
                self.in_sync or self.averager.global_state() is not None,
                lambda writes: self._save_shared(save, writes),
                make_common=self._average_for_checkpoint,
            )
        if final:  # the loop's last step took the final checkpoint
            return False
        # (a stop agreed for the very last step just lets the run finish)
        stopping = stop.should_stop(step) and step < self.max_steps
        due = every > 0 and (step % every == 0 or step == self.max_steps)
        if due or stopping:
            save(False)
        return stopping

    def _average_for_checkpoint(self) -> bool:
        """Under torchft with no common state between syncs (eager outer steps, plain
        streaming): a blocking average round, after which every worker holds the same model
        for the shared checkpoint; whether it committed."""
        self.in_sync = self._driver.average()
        return self.in_sync

    def own_state(self) -> dict | None:
        """What is this worker's own in a shared checkpoint: its error-feedback residuals (what
        it failed to send; the writer's would be every worker's otherwise), or None."""
        rounds = self.averager.rounds
        if not _holds_tensor(rounds.residuals):
            return None  # no error feedback: nothing of its own (and no state_dict's copies)
        return {"residuals": [w.state_dict() for w in rounds.wires]}

    def _save_shared(self, save: Callable[..., str], writes: bool) -> str:
        """The one state every worker holds (written by the worker that `writes`): the model
        itself when in sync, else the global state (Streaming DiLoCo's anchors) in the model's
        place for the save, so that a resume continues from it, losing only the local progress
        since each fragment's last sync."""
        if self.in_sync or not writes:
            return save(True, writes)
        flat = self.averager.flat  # sharded (mirror mode): the values live in the tensors
        local = [b.clone() for b in flat.current()]
        flat.assign(self.averager.global_state())
        self.in_sync = True  # what the checkpoint's loop state says: resumed, all start alike
        try:
            return save(True, writes)
        finally:
            self.in_sync = False
            flat.assign(local)

    def finish(self) -> None:
        """The final model is the average of the replicas: average once more if the last step
        was a local one (never in the no-communication baseline); with `sync.check_replicas`
        the final model is checked too (under torchft: inside the final round)."""
        if not self.in_sync and self.averager.ever_averages:
            self._driver.average()
            self.in_sync = True
            self.check_replicas(self.averager.step - 1, dist.get_rank())
        if self.drift is not None:  # no collective left in flight when the workers exit
            self.drift.wait()

    def writes_results(self, rank: int) -> bool:
        """Whether this worker evaluates the final model and writes `model.pt` and the summary:
        rank 0; under torchft the first live replica group's rank 0 (rank 0 unless lost)."""
        ft = self.fault_tolerance
        return rank == 0 if ft is None else ft.writes_results

    def evaluates_final(self, rank: int, sharding: Sharding) -> bool:
        """Sharded: whether this rank takes part in the final evaluation (FSDP's forward
        gathers from every rank of a group): the first replica group's ranks; under torchft
        every rank of the group whose rank 0 writes the results (the same quorum, so the same
        answer on each)."""
        ft = self.fault_tolerance
        return sharding.evaluates(rank) if ft is None else ft.rounds.leads

    def close(self) -> None:
        if self.fault_tolerance is not None:
            self.fault_tolerance.close()

    def summary(self) -> dict[str, Any]:
        """The strategy as run: the period of the average over every rank at the end (None if
        it never averages), the warmup, and each level's communication."""
        averager = self.averager
        widest = len(averager.levels) - 1
        summary = {
            "period": averager.period_of(widest) if averager.ever_averages else None,
            "warmup_steps": self.warmup_steps,
            "comm_levels": averager.comm_levels(),
        }
        if self.verify:
            summary["replica_checks"] = self.checks_done
        if self.trust is not None:  # each event as [rank, round]
            summary["trust"] = self.trust.record()
        if self.dropped_nonfinite.at:  # left out of all-reduced averages: [rank, step] each
            summary["dropped_nonfinite_at"] = [list(d) for d in self.dropped_nonfinite.at]
        if self.fault_tolerance is not None:
            rounds = self.fault_tolerance.rounds
            summary.update(
                self.fault_record(),
                participants_min=rounds.participants_min,
                heals=rounds.heals_seen,  # of any worker, counted alike by every worker
                failed_syncs=rounds.failed_syncs,
                retried_syncs=rounds.retried,  # failed syncs retried at once that committed
                # rounds that ran out of their grace window here, what they waited, the window
                grace_timeouts=rounds.comm.timeouts,
                grace_waited_s=round(rounds.comm.waited_s, 3),
                grace_s=round(rounds.comm.grace.seconds(), 3) if rounds.comm.grace else None,
                # samples whose training reached a committed global state, all workers'
                merged_samples=rounds.merged_samples,
            )
        return summary

    @property
    def moves_shards(self) -> bool:
        """Whether an excluded worker's shard may go to the others (`sync.excluded_shard`): not
        under torchft, where a worker that heals takes a peer's sampler, nor with sharded
        replica groups, where a worker is a group of ranks with a data shard each (null means
        skip there)."""
        return self.fault_tolerance is None and self.sharding is None

    @property
    def trust(self):
        """The rounds over untrusted workers' contributions (`localsgd.averaging.trust.
        TrustedRound`), or None under the all-reduced mean."""
        return self.averager.rounds.trust

    def trust_record(self) -> dict[str, Any]:
        """Every log line under a gathered sync: workers excluded, contributions dropped."""
        record = {} if self.trust is None else self.trust.metrics()
        if self.dropped_nonfinite.at:
            dropped = len(self.dropped_nonfinite.at)
            record["dropped_nonfinite"] = record.get("dropped_nonfinite", 0) + dropped
        return record

    def fault_record(self) -> dict[str, Any]:
        """Under ft=torchft: how many workers the last average included (every log line)."""
        ft = self.fault_tolerance
        return {} if ft is None else {"participants": ft.rounds.participants}

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the strategy, by the names checkpoints use."""
        state = {"averager": self.averager, "comm": self.stats}
        if self.drift is not None:
            state["drift"] = self.drift
        if self.fault_tolerance is not None:
            state["ft"] = self.fault_tolerance.rounds  # its counters
        return state


def _holds_tensor(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    return isinstance(tree, (list, tuple)) and any(_holds_tensor(t) for t in tree)

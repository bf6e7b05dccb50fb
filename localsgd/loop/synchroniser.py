"""The `Synchroniser`: everything the training loop knows of how replicas are kept together.

It holds the averager (`localsgd.loop.strategies.build_averager`), the synchronous warmup's
gradient averaging, drift measured around the averages that bring every replica together, and
the round driver that runs every sync: `LocalRounds` (straight through torch.distributed) or,
under `ft=torchft`, `FaultTolerance` (rounds of torchft's Manager: joining or healing at the
start, checkpoints and stops after committed rounds, which worker writes the results). The two
have the same methods, so neither the Synchroniser nor the trainer branches on fault tolerance;
the trainer reaches the averager only through the methods here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from localsgd.averaging import Averager, GradientAverager, OptimizerStateSync
from localsgd.averaging.flat import local_tensor
from localsgd.loop.checkpoint.averager_state import AveragerState
from localsgd.loop.drift import DriftMeter
from localsgd.loop.guards import DroppedContributions, check_replicas
from localsgd.loop.metrics import notice
from localsgd.loop.stop import StopAgreement

if TYPE_CHECKING:
    from localsgd.loop.fsdp import Sharding
    from localsgd.loop.local_rounds import LocalRounds


@dataclass
class RoundContribution:
    """What this worker is about to send in the sync after a step (`contribution_at`): the
    parameters it sends from (this rank's local shards), and what they are sent against: the
    averager's anchors (the model, or the syncing fragment's, at its last sync), or None where
    the averager keeps none (plain local SGD sends the values; their change is against the
    model after the last sync). `fragment`: Streaming DiLoCo's syncing fragment, else None."""

    step: int
    fragment: int | None
    params: list[torch.Tensor]
    anchors: list[torch.Tensor] | None
    parameters: list[torch.nn.Parameter]  # the parameters `params` are (the shards) of


class Synchroniser:
    """How the workers' replicas are kept together, as the training loop calls it.

    Before the first step the loop calls `start` (under torchft the first round: a restarted
    worker heals there). Around each optimizer step it calls `zero_grad`, `after_backward` (the
    warmup's gradient all-reduce; returns whether to step) and `after_step(loss, samples)` (the
    model average when the schedule says), then `checkpoint` (when due, or at an agreed stop).
    Between them it asks `in_sync` / `merged` (whether the replicas, or what they received, are
    identical now), `round_started`, `next_sync` and `common_tensors`; at the end `finish`,
    `writes_results` and `summary`. Callbacks reach a sync through `contribution_at` and
    `add_gradient_hook`.
    """

    def __init__(
        self,
        averager: Averager,
        model: torch.nn.Module,
        max_steps: int,
        driver: LocalRounds,
        grad_averager: GradientAverager | None = None,
        drift: DriftMeter | None = None,
        verify: bool = False,
        group: dist.ProcessGroup | None = None,
        sharding: Sharding | None = None,
    ):
        self.averager = averager
        self.driver = driver  # LocalRounds, or FaultTolerance (the same methods)
        self.sharding = sharding if sharding is not None and sharding.sharded else None
        self.group = group  # the replicas held alike (sharded replica groups: one shard's)
        self.verify = verify  # check after each sync that the replicas are bit-identical
        self.replica_checks = 0
        self.model = model
        self.max_steps = max_steps
        self.grad_averager = grad_averager
        self.gradient_hooks: list[Callable[[list[torch.Tensor]], None]] = []
        self.drift = drift
        if drift is not None:
            averager.global_hooks.append(drift)
        self.stats = averager.stats  # every collective's counters, the warmup's included
        self.in_sync = True  # the replicas are identical right now
        self.synchronous = False  # the step being taken belongs to the synchronous warmup
        self.announced = 0  # trust events announced so far (`_announce_trust`)
        # contributions an all-reduce left out for holding NaN/Inf (`averaging.finite`)
        self.dropped_nonfinite = DroppedContributions(averager.dropped_at)

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

    def computes(self) -> bool:
        """Whether this worker trains the next tick: always, but under asynchronous rounds'
        modelled clock, where a slower worker computes fewer of the ticks."""
        return self.averager.computes()

    @property
    def round_started(self) -> bool:
        """The last step started a round over every worker, blocking or launched (where a
        time budget's round ends: every worker must be there)."""
        return self.averager.started_round

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
        phase = self.driver.join(registry, optimizer_step, current_step(), every)
        if phase == "fresh":
            return 0
        done = 1
        if phase == "grad":  # the peer is inside the warmup step's gradient average
            self.synchronous = True
            self.after_step(None)
        elif phase == "sync":  # inside the peer's after_step: the average of step `step`
            self.in_sync = self.averager.all_in_sync
        else:  # "average": the final average, after the last step
            self.in_sync, done = True, 0
        notice(
            f"ft: worker {self.driver.worker} healed from a live peer; it trains on from step "
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
        if not skip:  # counted into the next round (torchft's merged samples)
            self.driver.stepped()
        if not self.synchronous:
            return not skip
        if self.gradient_hooks:
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            for hook in self.gradient_hooks:
                hook(grads)
        return self.driver.all_reduce_gradients()

    def idled(self) -> None:
        """This tick computes no step (a slow worker's, past the warmup): it is not one of the
        warmup's synchronous steps, whatever the last computed step was (a worker idle right
        after the warmup would otherwise count itself in sync and check its replica alone)."""
        self.synchronous = False

    def after_step(self, loss: torch.Tensor | None, samples: float = 0) -> None:
        """After the optimizer step, which trained on `samples` samples (0: it idled or was
        skipped; a weighted round's weight): feed the loss (None: skipped) to a schedule that
        adapts to it, then average when the schedule says."""
        averager = self.averager
        averager.trained(samples)
        if loss is not None and averager.needs_loss:
            # sharded: the replica group's loss, or each shard index would adapt its own way
            shards = self.sharding
            averager.observe_loss(loss if shards is None else shards.group_mean(loss))
        self.driver.maybe_average()
        self.in_sync = self.synchronous or averager.all_in_sync
        comms = [*averager.levels, *self.driver.comms]
        if self.grad_averager is not None:  # the warmup's gradients left out (guarded, robust)
            comms.append(self.grad_averager.comm)
        self.dropped_nonfinite.collect(comms, averager.step - 1)
        self._announce_trust()

    def add_gradient_hook(self, hook: Callable[[list[torch.Tensor]], None]) -> None:
        """`hook(grads)` runs before each warmup step's gradient average, with this rank's
        gradients (local shards), which it may rewrite in place (an attack; `loop.attacks`)."""
        self.gradient_hooks.append(hook)

    def contribution_at(self, step: int) -> RoundContribution | None:
        """What this worker sends in the round over every worker after step `step`, or None
        when there is none (for a callback between the optimizer step and the sync)."""
        averager = self.averager
        if step < self.warmup_steps or not averager.averages_all(step):
            return None
        part, _ = averager.round_at(step)
        rounds, flat = averager.rounds, averager.flat
        fragment = part if averager.parts > 1 else None
        params, anchors, parameters = [], [], []
        for t, (g, off, numel) in zip(flat.tensors, flat.slots, strict=True):
            if not isinstance(t, torch.nn.Parameter):
                continue
            if not any(sl.g == g and sl.start <= off < sl.end for sl in rounds.parts[part]):
                continue
            local = local_tensor(t)
            params.append(local)
            parameters.append(t)
            if rounds.anchored:
                anchors.append(rounds.anchors.first[g][off : off + numel].view_as(local))
        anchored = anchors if rounds.anchored else None
        return RoundContribution(step, fragment, params, anchored, parameters)

    def _announce_trust(self) -> None:
        """The worker that speaks (rank 0; under torchft the replica that led the last
        committed round) names each dropped contribution and excluded worker, once (every rank
        holds the same events)."""
        trust = self.trust
        if trust is None or len(trust.events) == self.announced:
            return
        fresh, self.announced = trust.events[self.announced :], len(trust.events)
        if self.driver.speaks:
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
        after step `step`, a sync (one gather; off by default; under torchft: inside each
        round, by the round driver)."""
        if self.verify and not self.driver.checks_inside:
            check_replicas(self.common_tensors(step), step, rank, self.group)
            self.replica_checks += 1

    @property
    def checks_done(self) -> int:
        """Syncs checked bit-identical so far (`sync.check_replicas`): the summary reports it,
        so that a mode the check would skip cannot pass for a checked one."""
        return self.replica_checks + self.driver.replica_checks

    # --- checkpoints and the end -----------------------------------------------------------------

    def checkpoint(
        self,
        step: int,
        every: int,
        stop: StopAgreement,
        save: Callable[..., str],
        final: bool = False,
    ) -> bool:
        """After step `step` (`final`: after the final average): checkpoint when due (every
        `every` steps and at the end) or at an agreed stop; True to stop the run there.
        `save(writes=True)` writes the checkpoint in the run's layout: every rank its own
        state, or (`shared_checkpoints`, under torchft) the one state every replica holds, by the
        worker that leads (`writes`)."""
        if self.driver.rolled_back:  # every worker holds the last global state
            self.in_sync = True
        return self.driver.checkpoint(
            step,
            self.max_steps,
            every,
            stop,
            save,
            final,
            in_sync=self.in_sync,
            shared=self.in_sync or self.averager.global_state() is not None,
            save_shared=lambda writes: self._save_shared(save, writes),
            make_common=self._average_for_checkpoint,
        )

    def _average_for_checkpoint(self) -> bool:
        """Where the workers hold no common state between syncs (eager outer steps, plain
        streaming, a stop between Streaming DiLoCo's syncs): a blocking average (under torchft
        a round), after which every worker holds the same model; whether it committed."""
        self.in_sync = self.driver.average()
        return self.in_sync

    def _save_shared(self, save: Callable[..., str], writes: bool) -> str:
        """The one state every worker holds (written by the worker that `writes`): the model
        itself when in sync, else the global state (Streaming DiLoCo's anchors) in the model's
        place for the save, so that a resume continues from it, losing only the local progress
        since each fragment's last sync."""
        if self.in_sync or not writes:
            return save(writes)
        flat = self.averager.flat  # sharded (mirror mode): the values live in the tensors
        local = [b.clone() for b in flat.current()]
        flat.assign(self.averager.global_state())
        self.in_sync = True  # what the checkpoint's loop state says: resumed, all start alike
        try:
            return save(writes)
        finally:
            self.in_sync = False
            flat.assign(local)

    def finish(self) -> None:
        """The final model is the average of the replicas: average once more if the last step
        was a local one (never in the no-communication baseline); with `sync.check_replicas`
        the final model is checked too (under torchft: inside the final round)."""
        if not self.in_sync and self.averager.ever_averages:
            self.driver.average()
            self.in_sync = True
            self.check_replicas(self.averager.step - 1, dist.get_rank())
        if self.drift is not None:  # no collective left in flight when the workers exit
            self.drift.wait()

    def writes_results(self, rank: int) -> bool:
        """Whether this worker evaluates the final model and writes `model.pt` and the summary:
        rank 0; under torchft the first live replica group's rank 0 (rank 0 unless lost)."""
        return self.driver.writes_results(rank)

    def evaluates_final(self, rank: int, sharding: Sharding) -> bool:
        """Sharded: whether this rank takes part in the final evaluation (FSDP's forward
        gathers from every rank of a group): the first replica group's ranks; under torchft
        every rank of the group whose rank 0 writes the results (the same quorum, so the same
        answer on each)."""
        return self.driver.evaluates_final(rank, sharding)

    def close(self) -> None:
        self.driver.close()

    # --- what the metrics and the summary say ---------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The strategy as run: the period of the average over every rank at the end (None if
        it never averages), the warmup, each level's communication, and the round driver's
        own (under torchft: participants, heals, failed syncs, ...)."""
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
        summary.update(self.driver.summary())
        summary.update(averager.summary())  # the averager's own record (asynchronous rounds')
        return summary

    def record(self) -> dict[str, Any]:
        """Every metrics line's share: optimizer state sent (`comm_bytes_<state>`), weighted
        rounds' weights, the driver's (participants) and a gathered sync's (excluded workers,
        drops)."""
        averager = self.averager
        out: dict[str, Any] = {}
        for hook in averager.hooks:  # sync.optimizer_state=average | desloc
            if isinstance(hook, OptimizerStateSync):
                out.update({f"comm_bytes_{k}": v for k, v in hook.bytes_by_state.items()})
        if averager.weighted:
            out["round_weights"] = averager.round_weights
            out["contributed_samples"] = averager.contributed
            out["wait_s"] = round(averager.wait_s, 6)
        out.update(self.driver.record())
        out.update(self.trust_record())
        return out

    def fault_record(self) -> dict[str, Any]:
        """Under ft=torchft: how many workers the last average included (every log line)."""
        return self.driver.record()

    @property
    def moves_shards(self) -> bool:
        """Whether an excluded worker's shard may go to the others (`sync.excluded_shard`): not
        under torchft, where a worker that heals takes a peer's sampler, nor with sharded
        replica groups, where a worker is a group of ranks with a data shard each (null means
        skip there)."""
        return not self.driver.checks_inside and self.sharding is None

    @property
    def trust(self):
        """The rounds over untrusted workers' contributions
        (`localsgd.averaging.trust.trusted_round.
        TrustedRound`), or None under the all-reduced mean."""
        return self.averager.rounds.trust

    def trust_record(self) -> dict[str, Any]:
        """Every log line under a gathered sync: workers excluded, contributions dropped."""
        record = {} if self.trust is None else self.trust.metrics()
        if self.dropped_nonfinite.at:
            dropped = len(self.dropped_nonfinite.at)
            record["dropped_nonfinite"] = record.get("dropped_nonfinite", 0) + dropped
        return record

    @property
    def buffer_dtypes(self) -> set[str]:
        """The dtypes of the flat buffers the averages run over (a mixed-precision run keeps
        them fp32 under bf16 parameters)."""
        return {str(b.dtype) for b in self.averager.flat.buffers}

    def state_bytes(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The training state this rank holds (`localsgd.loop.fsdp.state_bytes`)."""
        from localsgd.loop.fsdp import state_bytes

        return state_bytes(model, optimizer, self.averager)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the strategy, by the names checkpoints use; the averager
        as a checkpointed component (its own part of a shared checkpoint, how its state moves to
        another layout: `localsgd.loop.checkpoint.AveragerState`)."""
        state = {"averager": AveragerState(self.averager), "comm": self.stats}
        if self.drift is not None:
            state["drift"] = self.drift
        state.update(self.driver.checkpoint_state())  # under ft: its counters
        return state

    # what a checkpoint may lack of `checkpoint_state` (written without drift, or without ft)
    optional_state = ("drift", "ft")

    @property
    def shared_checkpoints(self) -> bool:
        """Whether checkpoints hold one state for every worker, written by one (under torchft,
        right after committed rounds), rather than every rank's own: the round driver's word."""
        return self.driver.shared_checkpoints

"""The averager contract and the loop every strategy shares.

An `Averager` is torch's `ModelAverager`: an integer `step` counter and `average_parameters(
params)`, called once after every `optimizer.step()`. It is composed of three parts:

- the rule for *when* (`round_at(step)`: which part of the model syncs after that step, at which
  level; `inner_level_at(step)`: a plain average inside smaller groups), given by the subclass
  (`PeriodicAverager`, `HierarchicalAverager`, `StreamingAverager`);
- a `Communicator` per level for *who* (the last level spans the whole process group);
- `Rounds` for *what* (`localsgd.averaging.rounds`): the stages of a round, the same for
  every rule: contribution, wire, transport and combine, outer step, merge.

The tensors averaged are views of persistent flat buffers, mirrored for sharded parameters
(`localsgd.averaging.binding`); what a round driver asks about each step is
`localsgd.averaging.driver_view`.

**Weighted rounds** (per-worker step counts, `weighted`): every round over all ranks weighs each
rank by the samples it trained on since that part's values last started from the global ones
(the owner reports each step's samples with `trained(n)`; `PartSamples`): since the part's last
round, or, for a launched one merged by replacement, since its merge. With `normalized` each
contribution is first scaled by the round's largest weight over its own (FedNova's normalized
averaging), so a slow rank's short change does not shrink the mean. Equal weights leave the
plain mean, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from localsgd.averaging.binding import FlatBinding, mirrored, parameters_of
from localsgd.averaging.comm import CommStats, Communicator
from localsgd.averaging.driver_view import RoundDriverView
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.rounds import Rounds
from localsgd.averaging.samples import PartSamples
from localsgd.averaging.schedule import ConstantPeriod
from localsgd.averaging.trust.robust import robust_mean_

__all__ = ["Averager", "AverageHook", "GlobalSyncHook", "mirrored", "parameters_of"]

# Called after every round with the level's communicator, `key` (the round's level and part,
# "level/part" or "level/all"), `params` (the ids of the parameters it covered; None: all) and
# `trust` (a robust round's verdicts, else None): e.g. averaging optimizer state.
AverageHook = Callable[..., None]
RoundsFactory = Callable[[FlatBuffers], Rounds]


class GlobalSyncHook(Protocol):
    """Called around every scheduled average that brings all ranks together (the widest level,
    or the merge of a delayed average) with the flat buffers: e.g. measuring replica drift."""

    def before(self, buffers: list[torch.Tensor]) -> None: ...

    def after(self, buffers: list[torch.Tensor]) -> None: ...


class Averager(FlatBinding, RoundDriverView, ModelAverager):
    """What the trainer depends on. Subclasses give `round_at`, `next_sync` and `period_of`
    (and `inner_level_at` where inner levels average plainly beside the rounds)."""

    # What a failed round across replica groups (torchft) restores: "commit", the state of the
    # last committed round (every replica holds it: the rounds replace the whole model), or
    # "round", the state from before the failed round (a part's round touches that part only,
    # and the others keep their local progress).
    failed_round_restores = "commit"

    def __init__(
        self,
        levels: list[Communicator],
        process_group: dist.ProcessGroup | None,
        *,
        module: torch.nn.Module | None,
        rounds: RoundsFactory,
        warmup_steps: int = 0,
        init_sync: bool | None = None,
        mirror: bool | None = None,
        delay: int = 0,
        parts: int = 1,
        schedule: ConstantPeriod | None = None,
        loss_rides: bool = False,
    ):
        super().__init__(process_group)  # `self.step = 0`, as torch's
        self.warmup_steps = warmup_steps
        # the period over training (`localsgd.averaging.schedule`): constant, stepped, or adapted
        # to the training loss, decided at the round that ends each cycle of the widest level
        self.schedule = schedule if schedule is not None else ConstantPeriod(1)
        self.last_average = warmup_steps - self.schedule.period_at(warmup_steps)
        # an adaptive period's loss rides in the buffers of a round that replaces the whole
        # model at once (PeriodicAverager's, where it always has); elsewhere the workers agree
        # on it by one small collective of its own at the cycle's last round (`_agree_loss`)
        self.loss_rides = loss_rides
        self.levels = levels  # levels[-1] spans the whole process group
        self.comm = levels[-1]
        self.stats = self.comm.stats  # shared by every level (and the warmup, in the trainer)
        self.level_stats = [CommStats() for _ in levels]  # each level's averages alone
        self.world_size = self.comm.size
        self.module = module
        self.make_rounds = rounds
        self.init_sync = init_sync
        self.mirror = mirror  # None: mirror exactly when a tensor is a DTensor (sharded)
        self.delay = delay  # τ: a round over every rank launches, and merges τ steps later
        self.parts = parts
        self.flat: FlatBuffers | None = None
        self.rounds: Rounds | None = None
        self.param_count = 0  # the first `param_count` tensors are the parameters
        self.extra_count = 0  # the last `extra_count` tensors ride along (extra_tensors)
        self.weighted = False
        self.normalized = False
        self.part_samples = PartSamples(parts, progress=False, levels=len(levels))
        # the last weighted round's weights, this rank's seconds in their exchange (where it
        # waits for the slowest), the samples global rounds merged (a fragment's as 1/P of them)
        self.round_weights: list[float] | None = None
        self.wait_s = 0.0
        self.contributed = 0.0
        # (rank, step) of each contribution an all-reduce left out for holding NaN/Inf
        # (`finite.NonFiniteGuard`), as the loop records them: checkpointed with the rest
        self.dropped_at: list[tuple[int, int]] = []
        self.hooks: list[AverageHook] = []
        self.global_hooks: list[GlobalSyncHook] = []
        self.all_in_sync = True  # every rank holds the same tensors (right after a full average)
        self.merged = False  # this step applied a delayed average (overlap, streaming merges)
        # this step started a round over every rank, blocking or launched: where a budget's
        # round ends (`localsgd.loop.pacing`), as every worker must be there
        self.started_round = False
        self.last_part: int | None = None  # merged (or eagerly stepped) by the last step
        if module is not None:
            self._bind(parameters_of(module.parameters()), averaged_tensors(module))

    # --- the rule, given by the subclass -------------------------------------------------------

    def round_at(self, step: int) -> tuple[int, int] | None:
        """(part, level) of the round that starts after step `step`, or None."""
        raise NotImplementedError

    def inner_level_at(self, step: int) -> int | None:
        """The level that averages the whole model plainly after step `step`, beside the
        rounds (Streaming DiLoCo's inner levels), or None."""
        return None

    def next_sync(self, step: int) -> int | None:
        """The first step >= `step` after which every rank takes part in an average (with a
        delayed round: the step that merges it, where the ranks wait for each other); None
        when the schedule never averages."""
        raise NotImplementedError

    def period_of(self, level: int) -> int:
        raise NotImplementedError

    def level_at(self, step: int) -> int | None:
        """Index of the level that averages after step `step`, or None."""
        at = self.round_at(step)
        return at[1] if at is not None else self.inner_level_at(step)

    def is_plain(self, p: int, step: int) -> bool:
        """Whether part p's round after `step` is its first after a synchronous warmup (an
        outer step takes it plainly)."""
        return False

    def acts_at(self, step: int) -> bool:
        """Whether the update after step `step` touches the flat buffers: an average at any
        level, or a delayed one's launch or merge (mirror mode copies only around those)."""
        return self.rounds.pending or self.level_at(step) is not None

    def extra_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """Tensors that ride along in the averages (an adaptive schedule's loss slot, which
        exists either way: `observe_loss` sums into it)."""
        slots = self.schedule.loss_slots(device)
        return slots if self.loss_rides else []

    @property
    def ever_averages(self) -> bool:
        """False for a schedule that never averages (the no-communication baseline)."""
        return self.schedule.averages

    def rule_state(self) -> dict:
        """The state of the rule for *when* that a round changes (an adaptive period's), which
        a failed round across replica groups puts back (`load_rule_state`)."""
        return {"last_average": self.last_average, "schedule": self.schedule.state_dict()}

    def load_rule_state(self, state: dict) -> None:
        if state:
            self.last_average = int(state["last_average"])
            self.schedule.load_state_dict(state["schedule"])

    def ends_cycle(self, p: int, level: int) -> bool:
        """Whether part p's round at `level` closes a cycle of the widest level (the schedule
        decides the next period there): its last part's."""
        return level == len(self.levels) - 1 and p == self.parts - 1

    def _before_reduce(self, comm: Communicator) -> None:
        self.schedule.before_sync()  # this worker's mean loss since the last decision
        self._extras_into_buffers()
        if self.schedule.needs_loss and not self.loss_rides:
            self._agree_loss(comm)

    def _after_reduce(self, scheduled: bool) -> None:
        self._extras_from_buffers()
        if scheduled:
            self.last_average = self.step
        self.schedule.after_sync()  # the same value on every rank: the same decision
        self._extras_into_buffers()

    def _agree_loss(self, comm: Communicator) -> None:
        """The workers' losses combined into the schedule's slot by one small collective: their
        mean, or under a robust round its rule over the workers it kept (an attacker's loss
        then cannot set everyone's period)."""
        slot = self.schedule.loss_slots(self.flat.buffers[0].device)[0]
        if self.rounds.gathered:
            robust_mean_(slot, comm, self.rounds.trust)
        else:
            comm.mean_(slot)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Feed this step's training loss to a schedule that adapts to it (no-op otherwise).
        Summed on the device: nothing is read back until the next sync."""
        self.schedule.observe_loss(loss)

    # --- the torch API and the trainer's ---------------------------------------------------

    def trained(self, samples: float) -> None:
        """This rank trained on `samples` more samples (call before the step's
        `maybe_average`): what a weighted round weighs it by."""
        self.part_samples.trained(samples)

    @staticmethod
    def resharded_state(state: dict) -> dict:
        """This averager's checkpointed `state` as workers of another world size resume it:
        every worker starts from one model, where every part's round starts afresh."""
        weighted = state.get("weighted")
        if weighted is None or "since" not in weighted:
            return state
        zeros = [[0.0] * len(row) for row in weighted["since"]]
        return {**state, "weighted": {**weighted, "since": zeros}}

    def average_parameters(self, params: Iterable | None = None) -> None:
        """torch's call: after every optimizer step; averages when the rule says, then advances
        `step`. The first call with `params` decides what is averaged (when no `module=` was
        given); later calls must pass the same parameters."""
        if params is not None:
            given = parameters_of(params)
            if self.flat is None:
                self._bind(given, given)
            else:
                self._follow_module()
                self._check_params(given)
        self.maybe_average()

    @mirrored(when_acting=True)
    def maybe_average(self) -> bool:
        """`average_parameters()` without the parameters: merges a round in flight, averages
        when the rule says, advances `step`. Returns whether it averaged (or launched one)."""
        self._bound()
        self.ensure_bound()
        rounds, step = self.rounds, self.step
        self.merged, self.last_part, self.received_mean = False, None, None
        if step < self.warmup_steps:  # synchronous: every part's change starts after it
            self.part_samples.restart()
        inner = self.inner_level_at(step)
        if inner is not None:
            self._inner_average(inner)
        for q in range(self.parts):  # a launched round τ steps ago merges
            if rounds.pending and rounds.holding[q] and rounds.pending_step[q] == step - self.delay:
                self._finish(q)
        at = self.round_at(step)
        if at is not None:
            self._round(*at, scheduled=True)
        widest = at is not None and at[1] == len(self.levels) - 1
        # a merge that replaces the whole model leaves every rank on the global values
        self.all_in_sync = self.merged and self.parts == 1 and self._replaces
        self.started_round = widest
        self.step += 1
        return at is not None or inner is not None

    @property
    def _replaces(self) -> bool:
        """A merge leaves the merged part equal to the global value on every rank."""
        return not (self.rounds.alpha or self.rounds.eager or self.rounds.progress)

    def _finish(self, q: int) -> None:
        self._global_hooks("before")  # a merge brings every rank onto the average
        self.rounds.finish(q, self.flat.buffers, self.comm, self.step)
        if self.weighted:
            self.part_samples.merged(len(self.levels) - 1, q)
        self._merged(q)

    def _merged(self, p: int) -> None:
        self._run_hooks(self.comm, len(self.levels) - 1, p)
        self._global_hooks("after")
        self.merged, self.last_part = True, p

    def _round(self, p: int, level: int, scheduled: bool) -> None:
        """Part p's round at `level`: launched (τ > 0, over every rank), eager, or blocking."""
        rounds, buffers, comm = self.rounds, self.flat.buffers, self.levels[level]
        widest = comm is self.comm
        before = self.stats.bytes
        decides = self.ends_cycle(p, level)
        if decides:
            self._before_reduce(comm)
        plain = self.is_plain(p, self.step)
        launched = scheduled and self.delay > 0 and widest
        scale = self._weigh(p, comm, launched, level) if self.weighted else None
        try:
            if launched:
                rounds.launch(p, buffers, comm, self.step, plain, scale)
            else:
                if widest and scheduled:
                    self._global_hooks("before")
                if rounds.eager and not plain and widest:
                    got = rounds.eager_round(p, buffers, comm, self.step, scale)
                else:
                    rounds.blocking(p, buffers, comm, level, self.step, plain, scale)
                    got = True
                if not widest:
                    self._run_hooks(comm, level, p)
                elif got and scheduled:
                    self._merged(p)
                elif scheduled:
                    self._global_hooks("after")
                else:
                    self._run_hooks(comm, level, p)
        finally:
            if self.weighted:
                comm.unweigh()
        self._count(level, before)
        if decides:
            self._after_reduce(scheduled)

    def _weigh(self, p: int, comm: Communicator, launched: bool, level: int) -> float | None:
        """Part p's weighted round at `level`: every rank's samples since p's values last
        started from that level's (or a wider one's) global ones. Returns the factor of this
        rank's contribution under `normalized` (the round's largest weight over its own), or
        None."""
        if self.rounds.gathered:
            raise ValueError(
                "weighted rounds weigh each worker by the samples it reports, and a robust "
                "aggregate combines the contributions unweighted (an untrusted worker could "
                "inflate its weight): set weighted=False"
            )
        own = self.part_samples.weight(level, p, launched)
        start = time.perf_counter()
        self.round_weights = comm.weigh(own, self.flat.buffers[0].device)
        self.wait_s += time.perf_counter() - start
        self.contributed += sum(self.round_weights) / self.parts if comm is self.comm else 0.0
        if not (self.normalized and comm.share):  # equal weights, or none trained here
            return None
        return max(self.round_weights) / own

    def _inner_average(self, level: int) -> None:
        """A plain fp32 mean of the whole model inside level `level`'s groups (Streaming
        DiLoCo's inner levels: the rounds' state is not touched)."""
        comm, before = self.levels[level], self.stats.bytes
        for flat in self.flat.buffers:
            comm.mean_(flat)
        self._run_hooks(comm, level, None)
        self._count(level, before)

    def _count(self, level: int, before: int) -> None:
        """One round of `level`, which sent what the counters gained since `before`."""
        self.stats.rounds += 1
        self.level_stats[level].rounds += 1
        self.level_stats[level].bytes += self.stats.bytes - before

    @mirrored()
    def average(self) -> None:
        """Average across every rank now, blocking, outside the schedule (e.g. before the final
        evaluation); a round still in flight is merged first (the hooks run once, after)."""
        self.ensure_bound()
        for q in range(self.parts):
            if self.rounds.pending and self.rounds.holding[q]:
                self.rounds.finish(q, self.flat.buffers, self.comm, self.step)
        self._round(0, len(self.levels) - 1, scheduled=False)
        self.all_in_sync = True

    def _global_hooks(self, when: str) -> None:
        for hook in self.global_hooks:
            getattr(hook, when)(self.flat.buffers)

    def _run_hooks(self, comm: Communicator, level: int, part: int | None) -> None:
        """After a round at `level` over part `part` (None: the whole model)."""
        whole = part is None or self.parts == 1
        key = f"{level}/{'all' if whole else part}"
        params = None if whole else self.part_params[part]
        trust = self.rounds.trust if self.rounds.gathered else None
        for hook in self.hooks:
            hook(comm, key=key, params=params, trust=trust)

    @property
    def needs_loss(self) -> bool:
        """Whether `observe_loss` feeds anything (a schedule that adapts to the loss)."""
        return self.schedule.needs_loss

    def summary(self) -> dict:  # what it records beyond the levels' counters (none here)
        return {}

    def comm_levels(self) -> list[dict]:
        """Per-level communication of the averages, for summaries."""
        return [
            {
                "group_size": comm.size,
                "period": self.period_of(i),
                "rounds": stats.rounds,
                "bytes": stats.bytes,
            }
            for i, (comm, stats) in enumerate(zip(self.levels, self.level_stats, strict=True))
        ]

    def state_dict(self) -> dict:
        state = {
            **self.rule_state(),
            "step": self.step,
            "levels": [s.state_dict() for s in self.level_stats],
            "rounds": self.rounds.state_dict(),
            # hooks that keep state (OptimizerStateSync's clock and byte counts), in list order
            "hooks": [h.state_dict() for h in self.hooks if hasattr(h, "state_dict")],
        }
        if self.dropped_at:
            state["dropped_nonfinite"] = [list(d) for d in self.dropped_at]
        if self.weighted:
            state["weighted"] = {
                "contributed": self.contributed,
                "round_weights": self.round_weights,
                "wait_s": self.wait_s,
                "since": self.part_samples.state_dict(),
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.load_rule_state(state if "last_average" in state else {})
        self.dropped_at[:] = [(int(r), int(s)) for r, s in state.get("dropped_nonfinite", [])]
        weighted = state.get("weighted")
        if weighted is not None:
            self.contributed = float(weighted["contributed"])
            self.round_weights = weighted["round_weights"]
            self.wait_s = float(weighted["wait_s"])
            if "since" in weighted:
                self.part_samples.load_state_dict(weighted["since"])
        for stats, saved in zip(self.level_stats, state.get("levels", []), strict=False):
            stats.load_state_dict(saved)
        stateful = [h for h in self.hooks if hasattr(h, "load_state_dict")]
        for hook, saved in zip(stateful, state.get("hooks", []), strict=False):
            hook.load_state_dict(saved)
        if self.flat is not None:  # (rounds after the rest: they read nothing of it)
            self.rounds.load_state_dict(state.get("rounds", {}))

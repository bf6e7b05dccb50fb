"""The averager contract and the skeleton every strategy shares.

An `Averager` is torch's `ModelAverager`: an integer `step` counter and `average_parameters(
params)`, called once after every `optimizer.step()`. It is composed of three parts:

- the rule for *when* (`level_at(step)`: which level averages after that step, if any), given by
  the subclass (`PeriodicAverager`, `HierarchicalAverager`);
- a `Communicator` per level for *who* (the last level spans the whole process group);
- a reducer for *what* (`localsgd.averaging.reduce`): plain, low-precision, outer or delayed.

The tensors averaged become views of persistent flat buffers, built from `module=` at
construction or from the parameters of the first `average_parameters(params)` call. Before each
average every tensor is checked to still live in its buffer and is put back if it left (torch
averages whatever the parameters are now, so must we).

Sharded parameters (DTensors: FSDP2's, `dist.shard_size`) are *mirrored* instead
(`FlatBuffers(mirror=True)`): the buffers hold copies of this rank's local shards, pulled in
before a step that acts (an average at any level, a launch, a merge; `acts_at`) and pushed back
after it, and nothing at the other steps, so the local phase stays free of collectives and
copies. Between those steps the buffers' storage is released, so a rank holds no second copy
of its shards. The reducers' state (anchors, outer momentum, residuals) is laid out like the
buffers, so it is sharded too. `mirrored` is the one place that happens.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from localsgd.averaging.comm import CommStats, Communicator
from localsgd.averaging.flat import FlatBuffers, averaged_tensors, holds_dtensor, param_lead
from localsgd.averaging.reduce import Reducer

# Called after every average with the level's communicator: e.g. averaging optimizer state.
AverageHook = Callable[[Communicator], None]
ReducerFactory = Callable[[FlatBuffers], Reducer]


class GlobalSyncHook(Protocol):
    """Called around every scheduled average that brings all ranks together (the widest level,
    or the merge of a delayed average) with the flat buffers: e.g. measuring replica drift."""

    def before(self, buffers: list[torch.Tensor]) -> None: ...

    def after(self, buffers: list[torch.Tensor]) -> None: ...


def parameters_of(params: Iterable) -> list[torch.Tensor]:
    """The floating-point tensors in `params`: parameters, or an optimizer's param groups
    (dicts), as torch's averagers accept. An integer parameter cannot be averaged; like an
    integer buffer it stays local."""
    out: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            out.extend(item["params"])
        elif isinstance(item, torch.Tensor):
            out.append(item)
        else:
            raise TypeError(
                f"average_parameters() takes parameters or param groups (dicts), got {type(item)}"
            )
    return [t for t in out if torch.is_floating_point(t)]


def mirrored(when_acting: bool = False):
    """Decorates an averager method that may act on the flat buffers: in mirror mode the
    tensors are pulled into the buffers before it and pushed back after it (`when_acting`:
    only when `acts_at(step)` says this step touches them). Without mirroring it is the method
    itself."""

    def wrap(method):
        @functools.wraps(method)
        def run(self: Averager, *args, **kwargs):
            flat = self._bound()
            if not flat.mirror or flat.pulled or (when_acting and not self.acts_at(self.step)):
                return method(self, *args, **kwargs)  # the unsharded path: nothing added
            flat.pull()
            try:
                return method(self, *args, **kwargs)
            finally:
                flat.push()

        return run

    return wrap


class Averager(ModelAverager):
    """What the trainer depends on. Subclasses give `level_at`, `next_sync` and `period_of`."""

    def __init__(
        self,
        levels: list[Communicator],
        process_group: dist.ProcessGroup | None,
        *,
        module: torch.nn.Module | None,
        reducer: ReducerFactory | None,
        warmup_steps: int = 0,
        init_sync: bool | None = None,
        mirror: bool | None = None,
    ):
        super().__init__(process_group)  # `self.step = 0`, as torch's
        self.warmup_steps = warmup_steps
        self.levels = levels  # levels[-1] spans the whole process group
        self.comm = levels[-1]
        self.stats = self.comm.stats  # shared by every level (and the warmup, in the trainer)
        self.level_stats = [CommStats() for _ in levels]  # each level's averages alone
        self.world_size = self.comm.size
        self.module = module
        self.make_reducer = reducer if reducer is not None else (lambda flat: Reducer())
        self.init_sync = init_sync
        self.mirror = mirror  # None: mirror exactly when a tensor is a DTensor (sharded)
        self.flat: FlatBuffers | None = None
        self.reducer: Reducer = Reducer()
        self.param_count = 0  # the first `param_count` tensors are the parameters
        self.extra_count = 0  # the last `extra_count` tensors ride along (extra_tensors)
        # Weighted rounds (per-worker step counts): with `weighted`, every average over all
        # ranks weighs each rank by its `contribution` (e.g. the samples it trained on since
        # the last one); `round_weights` are the last round's, `wait_s` the seconds this rank
        # spent in their exchange (where it waits for the slowest), `contributed` their sum
        # over every round so far
        self.weighted = False
        self.contribution = 0.0
        # all the samples this rank has trained on: a fragment's weight is what it gained since
        # that fragment's last sync (`StreamingAverager`)
        self.samples_trained = 0.0
        # ... and with `normalized`, each rank's change since the last average (its pseudo-
        # gradient) is first scaled by the round's largest weight over its own: the weighted
        # mean is then the samples-weighted mean change per sample times the most samples any
        # rank trained on (FedNova's normalized averaging), so a slow rank's short change does
        # not shrink it. Equal weights leave the plain mean, bit for bit.
        self.normalized = False
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
        if module is not None:
            self._bind(parameters_of(module.parameters()), averaged_tensors(module))

    # --- the rule, given by the subclass -------------------------------------------------------

    def level_at(self, step: int) -> int | None:
        """Index of the level that averages after step `step`, or None."""
        raise NotImplementedError

    def next_sync(self, step: int) -> int | None:
        """The first step >= `step` after which every rank takes part in an average (with a
        delayed reducer: the step that merges it, where the ranks wait for each other); None
        when the schedule never averages."""
        raise NotImplementedError

    def period_of(self, level: int) -> int:
        raise NotImplementedError

    def acts_at(self, step: int) -> bool:
        """Whether the update after step `step` touches the flat buffers: an average at any
        level, or a delayed one's launch or merge (mirror mode copies only around those)."""
        return self.reducer.pending or self.level_at(step) is not None

    def extra_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """Tensors that ride along in the averages (an adaptive schedule's loss slot)."""
        return []

    def _before_reduce(self) -> None:
        pass

    def _after_reduce(self, scheduled: bool) -> None:
        pass

    # --- binding -------------------------------------------------------------------------------

    def _bind(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        self.param_count = len(params)
        device = tensors[0].device if tensors else torch.device("cpu")
        extra = self.extra_tensors(device)
        mirror = holds_dtensor(tensors) if self.mirror is None else self.mirror
        self.extra_count = len(extra)
        self.flat = FlatBuffers(tensors + extra, mirror=mirror)
        self.reducer = self.make_reducer(self.flat)
        # An anchor (DiLoCo, SlowMo, compressed changes) taken from differing replicas would keep
        # them apart for good, so those start from rank 0's tensors, as DDP does when built.
        if self.reducer.anchored if self.init_sync is None else self.init_sync:
            self.broadcast_(src=0)
        self.flat.release()  # mirror: held only while a step acts (the reducer took its copies)

    def _bound(self) -> FlatBuffers:
        if self.flat is None:
            raise ValueError(
                "the averager holds no parameters yet: pass them to average_parameters(params) "
                "or build it with module=..."
            )
        return self.flat

    def _follow_module(self) -> None:
        """`load_state_dict(assign=True)` swaps new Parameter objects into the module."""
        if self.module is None:
            return
        held = self._bound().tensors
        current = averaged_tensors(self.module) + self.extra_tensors(held[0].device)
        if len(current) != len(held) or any(a is not b for a, b in zip(current, held, strict=True)):
            self.flat.replace(current)

    def ensure_bound(self) -> None:
        """Put back every tensor that left its buffer (cheap: one pointer compare per tensor)."""
        self._follow_module()
        convert = self._bound().rebind()
        if convert is not None:
            self.reducer.relayout(convert)

    def _check_params(self, given: list[torch.Tensor]) -> None:
        held = self._bound().tensors[: self.param_count]
        held_ids = {id(t) for t in held}
        foreign = sum(id(t) not in held_ids for t in given)
        if foreign or len({id(t) for t in given}) != len(held_ids):
            raise ValueError(
                f"average_parameters() got {len(given)} parameters ({foreign} not held), the "
                f"averager holds {len(held)}: it averages the tensors it was built with; build a "
                "new averager for other parameters"
            )

    # --- the torch API and the trainer's ---------------------------------------------------

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
        """`average_parameters()` without the parameters: merges an average in flight, averages
        when the rule says, advances `step`. Returns whether it averaged (or launched one)."""
        flat = self._bound()
        self.merged = False
        if self.reducer.pending:
            self.ensure_bound()
            self._global_hooks("before")  # a merge brings every rank onto the average
            self.reducer.finish_(flat.buffers)
            self._run_hooks(self.comm)
            self._global_hooks("after")
            self.merged = True
        level = self.level_at(self.step)
        if level is not None:
            self._average(level, delayed=self.reducer.delays, scheduled=True)
        self.all_in_sync = (
            level is not None and not self.reducer.delays and self.levels[level] is self.comm
        )
        self.started_round = level is not None and self.levels[level] is self.comm
        self.step += 1
        return level is not None

    @mirrored()
    def average(self) -> None:
        """Average across every rank now, blocking, outside the schedule (e.g. before the final
        evaluation); an average still in flight is merged first (the hooks run once, after)."""
        if self.reducer.pending:
            self.ensure_bound()
            self.reducer.finish_(self._bound().buffers)
        self._average(len(self.levels) - 1, delayed=False, scheduled=False)
        self.all_in_sync = True

    def _average(self, level: int, delayed: bool, scheduled: bool) -> None:
        self.ensure_bound()
        buffers = self.flat.buffers
        comm = self.levels[level]
        observed = scheduled and not delayed and comm is self.comm
        before = self.stats.bytes
        self._before_reduce()
        self._extras_into_buffers()
        weighs = self.weighted and comm is self.comm
        if weighs:
            start = time.perf_counter()
            self.round_weights = comm.weigh(self.contribution, buffers[0].device)
            self.wait_s += time.perf_counter() - start
            self.contributed += sum(self.round_weights)
            if self.normalized and comm.share:  # unequal weights, this rank's above 0
                self._scale_change(max(self.round_weights))
        if observed:
            self._global_hooks("before")
        if delayed:
            self.reducer.launch_(buffers, comm)
        else:
            try:
                self.reducer.reduce_(buffers, comm, level, self.step)
            finally:
                self.reducer.change_scale = None
            self._run_hooks(comm)
        if observed:
            self._global_hooks("after")
        if weighs:
            comm.unweigh()
        self.stats.rounds += 1
        self.level_stats[level].rounds += 1
        self.level_stats[level].bytes += self.stats.bytes - before
        self._extras_from_buffers()
        self._after_reduce(scheduled)
        self._extras_into_buffers()

    @torch.no_grad()
    def _extras_into_buffers(self) -> None:
        """Mirror mode: the buffers hold copies, taken before the schedule's `before_sync` /
        `after_sync` changed its loss slot; refresh them, so the reduction averages what the
        schedule prepared and the push after the step writes back what it left."""
        if self.flat.mirror and self.extra_count:
            n = len(self.flat.tensors) - self.extra_count
            for t, v in zip(self.flat.tensors[n:], self.flat.views[n:], strict=True):
                v.copy_(t)

    @torch.no_grad()
    def _extras_from_buffers(self) -> None:
        """Mirror mode: hand the reduced loss slot to the schedule before it reads it."""
        if self.flat.mirror and self.extra_count:
            n = len(self.flat.tensors) - self.extra_count
            for t, v in zip(self.flat.tensors[n:], self.flat.views[n:], strict=True):
                t.copy_(v)

    def _scale_change(self, largest: float) -> None:
        """Ask the reducer to scale this rank's change by `largest` over its own weight (see
        `normalized`), over the parameters."""
        if not self.reducer.scales_changes:
            raise ValueError(
                f"normalized weighted rounds scale each change since the last average, which "
                f"{type(self.reducer).__name__} does not keep: build the averager with "
                "round_starts=True, or set normalized=False"
            )
        self.reducer.change_scale = (largest / self.contribution, param_lead(self.flat))

    def _global_hooks(self, when: str) -> None:
        for hook in self.global_hooks:
            getattr(hook, when)(self.flat.buffers)

    def _run_hooks(self, comm: Communicator) -> None:
        for hook in self.hooks:
            hook(comm)

    def averages_all(self, step: int) -> bool:
        """Whether the update after step `step` averages over every rank (the widest level)."""
        level = self.level_at(step)
        return level is not None and self.levels[level] is self.comm

    # What a failed round across replica groups (torchft) restores: "commit", the state of the
    # last committed round (every replica holds it: the averages replace the whole model), or
    # "round", the state from before the failed round (Streaming DiLoCo: a fragment's sync
    # touches that fragment only, and the others keep their local progress).
    failed_round_restores = "commit"
    rounds_overlap = False  # one step closes a round and opens the next (see StreamingAverager)

    @property
    def delayed_syncs(self) -> bool:
        """Whether a sync over every rank is launched after one step and merged after a later
        one (`sync_at` says "launch", then "merge"), rather than done within one step."""
        return self.reducer.delays

    def sync_at(self, step: int) -> str | None:
        """What the update after step `step` does across every rank: None (nothing, or an
        inner level's average), "sync" (a blocking average over every rank), "launch" (a
        delayed one opens) or "merge" (one launched earlier closes). A round driver (torchft's)
        runs a round around each."""
        if self.averages_all(step):
            return "launch" if self.reducer.delays else "sync"
        return "merge" if self.reducer.delays and self.reducer.pending else None

    @property
    def ever_averages(self) -> bool:
        """False for a schedule that never averages (the no-communication baseline)."""
        return True

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step belongs to the synchronous warmup."""
        return self.step < self.warmup_steps

    def common_tensors(self) -> list[torch.Tensor]:
        """Flat tensors every rank holds identically right now: the buffers after a full
        average; after a delayed merge, the average received (the buffers hold local progress)."""
        if self.merged and not self.all_in_sync:
            return self.reducer.averages
        return self._bound().current()  # mirror, between steps: a transient copy

    def complete_launched(self) -> None:
        """Wait for the collectives this averager launched and left in flight (none here; a
        round driver calls it before closing a round, whose process group may not outlive it)."""

    def global_state(self) -> list[torch.Tensor] | None:
        """Between syncs, flat tensors (laid out as the flat buffers) that every rank holds
        identically and that training can continue from, losing only the local progress since
        (a checkpoint of it: `Synchroniser.checkpoint`); None where there are none (the replicas
        are together only right after a sync)."""
        return None

    @property
    def needs_loss(self) -> bool:
        """Whether `observe_loss` feeds anything (a schedule that adapts to the loss)."""
        return self.extra_count > 0

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Feed this step's training loss to a schedule that adapts to it (no-op otherwise)."""

    @mirrored()
    def broadcast_(self, src: int = 0) -> None:
        """Give every rank rank `src`'s tensors (`src`: a rank of the averager's group; setup:
        not counted as training communication)."""
        for flat in self._bound().buffers:
            self.comm.broadcast_(flat, src)
        self.reducer.reset(self.flat.buffers)

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
            "step": self.step,
            "levels": [s.state_dict() for s in self.level_stats],
            "reducer": self.reducer.state_dict(),
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
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.dropped_at[:] = [(int(r), int(s)) for r, s in state.get("dropped_nonfinite", [])]
        weighted = state.get("weighted")
        if weighted is not None:
            self.contributed = float(weighted["contributed"])
            self.round_weights = weighted["round_weights"]
            self.wait_s = float(weighted["wait_s"])
        for stats, saved in zip(self.level_stats, state.get("levels", []), strict=False):
            stats.load_state_dict(saved)
        stateful = [h for h in self.hooks if hasattr(h, "load_state_dict")]
        for hook, saved in zip(stateful, state.get("hooks", []), strict=False):
            hook.load_state_dict(saved)
        if self.flat is not None:
            self.reducer.load_state_dict(state.get("reducer", {}))

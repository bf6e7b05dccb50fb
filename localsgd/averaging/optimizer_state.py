"""What happens to the inner optimizer's state (momentum, Adam moments) at a sync.

torch's averagers leave it local: each worker keeps its own momentum, which then points along its
own shard's gradients. `average` averages it over the same group as the parameters; `reset`
drops it, so every worker restarts its momentum from the averaged model.

`desloc` (DES-LOC, arXiv 2505.22549) averages each moment on its own, longer period: the first
moments at every `moment_periods[0]`-th parameter average, the second moments at every
`moment_periods[1]`-th (the paper's K_u = 3 K_x and K_v = 6 K_x: `[3, 6]`). A state named
`exp_avg_sq` or `max_exp_avg_sq` is a second moment; every other floating-point state (Adam's
`exp_avg`, SGD's and Muon's `momentum_buffer`) a first moment.

The hook runs after every round with the round's communicator and what the round covered: the
whole model, or one of Streaming DiLoCo's fragments, whose parameters' state alone is averaged
then (each fragment's state is averaged as often as its parameters are). Averages are counted
per level and part from the hook's start (the first parameter average is number 1: `clocks`),
checkpointed with the averager (`state_dict`), so a resumed run keeps the same schedule. Under a
robust round (`sync.aggregate`, `sync.score`) the state is combined by the round's rule over the
workers it kept, never by the plain mean an attacker's state would move.

Every mode that sends state counts its bytes per state name in `bytes_by_state` (`exp_avg`,
`exp_avg_sq`, ...), what the trainer logs as `comm_bytes_<name>`; they are part of `comm_bytes`.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers, holds_dtensor, local_tensor
from localsgd.averaging.trust.robust import robust_mean_

OPTIMIZER_STATE_MODES = ("local", "average", "reset", "desloc")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
DESLOC_PERIODS = (3, 6)  # the paper's K_u / K_x and K_v / K_x
WHOLE = "0/all"  # the clock of the whole model's averages at the first level


class OptimizerStateSync:
    """A hook for an averager's `hooks`: called after every round with the round's
    `Communicator`, through which the state is averaged (so it counts and obeys a slow link).

    For `average` and `desloc`, the optimizer's floating-point state tensors (not Adam's `step`
    counter) become views of persistent flat buffers the first time (one set per moment and part
    under `desloc`), rebuilt only if the optimizer replaced them (e.g. `load_state_dict`); their
    bytes count in the same round. `moment_periods`: `desloc`'s (first, second) moment periods,
    in parameter averages.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str,
        moment_periods: tuple[int, int] | list[int] = DESLOC_PERIODS,
    ):
        if mode not in OPTIMIZER_STATE_MODES:
            raise ValueError(
                f"optimizer_state must be one of {', '.join(OPTIMIZER_STATE_MODES)}, got {mode!r}"
            )
        periods = tuple(int(p) for p in moment_periods)
        if len(periods) != 2 or min(periods) < 1:
            raise ValueError(f"moment_periods must be two integers >= 1, got {moment_periods!r}")
        self.optimizer = optimizer
        self.mode = mode
        self.moment_periods = periods
        self.clocks: dict[str, int] = {}  # parameter averages seen, per level and part
        self.bytes_by_state: dict[str, int] = {}
        self.flat: dict[tuple, FlatBuffers] = {}  # per moment and part
        self.bound_ids: dict[tuple, list[int]] = {}

    @property
    def averages(self) -> int:
        """Parameter averages this hook has seen, over every level and part."""
        return sum(self.clocks.values())

    def _state_tensors(
        self, moment: str, params: frozenset | None
    ) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the floating-point state of `moment` (all, first or second) of
        the parameters whose ids are in `params` (None: every parameter)."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if params is not None and id(p) not in params:
                    continue
                for key, value in self.optimizer.state.get(p, {}).items():
                    if key == "step" or not torch.is_tensor(value):
                        continue
                    if not value.is_floating_point():
                        continue
                    second = key in SECOND_MOMENTS
                    if moment == "all" or (moment == "second") == second:
                        out.append((key, value))
        return out

    def _average(self, moment: str, comm: Communicator, key: str, params, trust) -> None:
        named = self._state_tensors(moment, params)
        if not named:
            return  # no state yet (no step taken, or plain SGD without momentum)
        tensors = [t for _, t in named]
        ids = [id(t) for t in tensors]
        slot = (moment, key)
        flat = self.flat.get(slot)
        if flat is None or ids != self.bound_ids.get(slot) or not flat.is_bound():
            # a sharded model's state is DTensors (FSDP2): mirrored through the local shards,
            # averaged with the ranks that hold the same shards, held only during the average
            flat = self.flat[slot] = FlatBuffers(tensors, mirror=holds_dtensor(tensors))
            flat.release()
            self.bound_ids[slot] = ids
        if flat.mirror:
            flat.pull()
        for buffer in flat.buffers:
            if trust is None:
                comm.mean_(buffer)
            else:
                robust_mean_(buffer, comm, trust)
        if flat.mirror:
            flat.push()
        for name, t in named:  # what the round counted, by state name
            self.bytes_by_state[name] = self.bytes_by_state.get(name, 0) + _nbytes(t)

    def __call__(
        self,
        comm: Communicator,
        key: str = WHOLE,
        params: frozenset | None = None,
        trust=None,
    ) -> None:
        """After a round over `comm`: `key` names the round's level and part (its own clock),
        `params` the ids of the parameters it covered (None: all), `trust` the round's verdict
        state (`TrustedRound`) when it was robust (None: the mean)."""
        if self.mode == "local":
            return
        if self.mode == "reset":
            for p in list(self.optimizer.state):
                if params is None or id(p) in params:
                    del self.optimizer.state[p]
            return
        self.clocks[key] = done = self.clocks.get(key, 0) + 1
        if self.mode == "average":
            self._average("all", comm, key, params, trust)
            return
        for moment, period in zip(("first", "second"), self.moment_periods, strict=True):
            if done % period == 0:
                self._average(moment, comm, key, params, trust)

    def snapshot(self) -> list[torch.Tensor]:
        """Every floating-point state tensor, cloned: what a failed round puts back
        (`restore`), as it may have averaged some."""
        return [t.detach().clone() for _, t in self._state_tensors("all", None)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        current = [t for _, t in self._state_tensors("all", None)]
        if len(current) == len(saved):
            with torch.no_grad():
                for t, value in zip(current, saved, strict=True):
                    t.copy_(value)

    def state_dict(self) -> dict:
        return {"clocks": dict(self.clocks), "bytes_by_state": dict(self.bytes_by_state)}

    def load_state_dict(self, state: dict) -> None:
        if "clocks" in state:
            self.clocks = {str(k): int(v) for k, v in state["clocks"].items()}
        else:  # a checkpoint of one clock
            self.clocks = {WHOLE: int(state.get("averages", 0))} if state.get("averages") else {}
        self.bytes_by_state = {k: int(v) for k, v in state.get("bytes_by_state", {}).items()}


def _nbytes(t: torch.Tensor) -> int:
    local = local_tensor(t)  # what this rank sends of a sharded state
    return local.numel() * local.element_size()

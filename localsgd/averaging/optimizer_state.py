"""What happens to the inner optimizer's state (momentum, Adam moments) at a sync.

torch's averagers leave it local: each worker keeps its own momentum, which then points along its
own shard's gradients. `average` averages it over the same group as the parameters; `reset`
drops it, so every worker restarts its momentum from the averaged model.

`desloc` (DES-LOC, arXiv 2505.22549) averages each moment on its own, longer period: the first
moments at every `moment_periods[0]`-th parameter average, the second moments at every
`moment_periods[1]`-th (the paper's K_u = 3 K_x and K_v = 6 K_x: `[3, 6]`). A state named
`exp_avg_sq` or `max_exp_avg_sq` is a second moment; every other floating-point state (Adam's
`exp_avg`, SGD's and Muon's `momentum_buffer`) a first moment. Averages are counted from the
hook's start (the first parameter average is number 1) and the count is checkpointed with the
averager (`state_dict`), so a resumed run keeps the same schedule.

Every mode that sends state counts its bytes per state name in `bytes_by_state` (`exp_avg`,
`exp_avg_sq`, ...), what the trainer logs as `comm_bytes_<name>`; they are part of `comm_bytes`.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers, holds_dtensor, local_tensor

OPTIMIZER_STATE_MODES = ("local", "average", "reset", "desloc")
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
DESLOC_PERIODS = (3, 6)  # the paper's K_u / K_x and K_v / K_x


class OptimizerStateSync:
    """A hook for an averager's `hooks`: called after every average with the level's
    `Communicator`, through which the state is averaged (so it counts and obeys a slow link).

    For `average` and `desloc`, the optimizer's floating-point state tensors (not Adam's `step`
    counter) become views of persistent flat buffers the first time (one set per moment under
    `desloc`), rebuilt only if the optimizer replaced them (e.g. `load_state_dict`); their bytes
    count in the same round. `moment_periods`: `desloc`'s (first, second) moment periods, in
    parameter averages.
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
        self.averages = 0  # parameter averages this hook has seen (desloc's clock)
        self.bytes_by_state: dict[str, int] = {}
        self.flat: dict[str, FlatBuffers] = {}  # per moment ("all" under average)
        self.bound_ids: dict[str, list[int]] = {}

    def _state_tensors(self, moment: str) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the floating-point state of `moment`: all, first or second."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if key == "step" or not torch.is_tensor(value):
                        continue
                    if not value.is_floating_point():
                        continue
                    second = key in SECOND_MOMENTS
                    if moment == "all" or (moment == "second") == second:
                        out.append((key, value))
        return out

    def _average(self, moment: str, comm: Communicator) -> None:
        named = self._state_tensors(moment)
        if not named:
            return  # no state yet (no step taken, or plain SGD without momentum)
        tensors = [t for _, t in named]
        ids = [id(t) for t in tensors]
        flat = self.flat.get(moment)
        if flat is None or ids != self.bound_ids.get(moment) or not flat.is_bound():
            # a sharded model's state is DTensors (FSDP2): mirrored through the local shards,
            # averaged with the ranks that hold the same shards, held only during the average
            flat = self.flat[moment] = FlatBuffers(tensors, mirror=holds_dtensor(tensors))
            flat.release()
            self.bound_ids[moment] = ids
        if flat.mirror:
            flat.pull()
        for buffer in flat.buffers:
            comm.mean_(buffer)
        if flat.mirror:
            flat.push()
        for name, t in named:  # what mean_ counted, by state name
            self.bytes_by_state[name] = self.bytes_by_state.get(name, 0) + _nbytes(t)

    def __call__(self, comm: Communicator) -> None:
        if self.mode == "local":
            return
        if self.mode == "reset":
            self.optimizer.state.clear()
            return
        self.averages += 1
        if self.mode == "average":
            self._average("all", comm)
            return
        for moment, period in zip(("first", "second"), self.moment_periods, strict=True):
            if self.averages % period == 0:
                self._average(moment, comm)

    def state_dict(self) -> dict:
        return {"averages": self.averages, "bytes_by_state": dict(self.bytes_by_state)}

    def load_state_dict(self, state: dict) -> None:
        self.averages = int(state.get("averages", 0))
        self.bytes_by_state = {k: int(v) for k, v in state.get("bytes_by_state", {}).items()}


def _nbytes(t: torch.Tensor) -> int:
    local = local_tensor(t)  # what this rank sends of a sharded state
    return local.numel() * local.element_size()

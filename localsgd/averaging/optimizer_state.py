"""What happens to the inner optimizer's state (momentum, Adam moments) at a sync.

torch's averagers leave it local: each worker keeps its own momentum, which then points along its
own shard's gradients. `average` averages it over the same group as the parameters; `reset`
drops it, so every worker restarts its momentum from the averaged model.
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import FlatBuffers, holds_dtensor

OPTIMIZER_STATE_MODES = ("local", "average", "reset")


class OptimizerStateSync:
    """A hook for an averager's `hooks`: called after every average with the level's
    `Communicator`, through which the state is averaged (so it counts and obeys a slow link).

    For `average`, the optimizer's floating-point state tensors (not Adam's `step` counter)
    become views of persistent flat buffers the first time, rebuilt only if the optimizer
    replaced them (e.g. `load_state_dict`); their bytes count in the same round.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str):
        if mode not in OPTIMIZER_STATE_MODES:
            raise ValueError(
                f"optimizer_state must be one of {', '.join(OPTIMIZER_STATE_MODES)}, got {mode!r}"
            )
        self.optimizer = optimizer
        self.mode = mode
        self.flat: FlatBuffers | None = None
        self.bound_ids: list[int] = []

    def _state_tensors(self) -> list[torch.Tensor]:
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                        out.append(value)
        return out

    def __call__(self, comm: Communicator) -> None:
        if self.mode == "local":
            return
        if self.mode == "reset":
            self.optimizer.state.clear()
            return
        tensors = self._state_tensors()
        if not tensors:
            return  # no state yet (no step taken, or plain SGD without momentum)
        ids = [id(t) for t in tensors]
        if self.flat is None or ids != self.bound_ids or not self.flat.is_bound():
            # a sharded model's state is DTensors (FSDP2): mirrored through the local shards,
            # averaged with the ranks that hold the same shards, held only during the average
            self.flat = FlatBuffers(tensors, mirror=holds_dtensor(tensors))
            self.flat.release()
            self.bound_ids = ids
        if self.flat.mirror:
            self.flat.pull()
        for flat in self.flat.buffers:
            comm.mean_(flat)
        if self.flat.mirror:
            self.flat.push()

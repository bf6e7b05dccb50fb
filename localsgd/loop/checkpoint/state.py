"""What a checkpoint holds: the trainer's registry of stateful components, and how each one's
state moves to another world size or shard size.

The trainer registers everything a checkpoint holds once (`Trainer.stateful`: the model, the
optimizer, the averager, the sampler, RNG, the loop, ...); saving and resuming walk that
mapping. Every component has `state_dict()` and `load_state_dict(state)`. A resume at another
layout asks each component for its state there: `resharded_state(states, reshard)`, given the
old workers' states of that component (`states`, by old rank) and what the move is (`Reshard`);
it returns the state to load, or None to keep its own (a new rank's random generators). Each
component owns that rule:

- the model (`ModuleState`): the averaged model at a sync or with an outer step (whose anchor
  then takes over, `AveragerState.after_reshard`), else the old workers' mean;
- torch's optimizers (they cannot carry the method; `moved_optimizer_state`): the old workers'
  mean moments, step counts the first's;
- the averager (`averager_state.AveragerState`): anchors and outer momentum cut to the new
  shards, error-feedback residuals each worker's own or summed over the old workers, weighted
  rounds started afresh;
- the data (`localsgd.data.ShardSampler`), the pacer (`localsgd.loop.pacing.Pacer`), RNG here;
- anything else: the state every worker shared (`Reshard.source`'s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from localsgd.averaging.trees import is_float, is_float_array, tree_mean


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


@dataclass(frozen=True)
class Reshard:
    """A resume at another layout, as the components see it: rank `rank` of `world_size`
    workers in groups of `shard_size` continues a checkpoint written by `old_world` workers in
    groups of `old_shards`, taken at a sync (`at_sync`) or not, by a strategy with an outer step
    over an anchor (`outer`) or not; `shared`: the checkpoint holds one state for every worker
    (ft=torchft; sharded: one replica group's), with what is each worker's own beside it."""

    folder: str
    rank: int
    world_size: int
    shard_size: int
    old_world: int
    old_shards: int
    shared: bool
    at_sync: bool
    outer: bool
    device: torch.device | str = "cpu"

    @property
    def source(self) -> int:
        """The old rank state this rank takes what every worker shared from: the first, or in a
        shared sharded checkpoint the writing group's rank that held this rank's shard."""
        return self.rank % self.old_shards if self.shared else 0

    @property
    def sharded(self) -> bool:
        """Whether either layout shards the model (flat state is cut to other shards)."""
        return self.old_shards > 1 or self.shard_size > 1


class ModuleState:
    """A module's state, cloned on save: its tensors are views of the averager's flat buffers,
    and `torch.save` of a view writes the whole buffer."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)  # copies into the flat buffers' views

    @staticmethod
    def resharded_state(states: list[dict], reshard: Reshard) -> dict:
        """At a sync every worker held the averaged model; with an outer step the anchor
        replaces it after loading; between syncs otherwise the old workers' mean, parameters
        and floating-point buffers (summed in rank order, divided once; integer buffers the
        first's): the average the next sync would have started from."""
        if reshard.at_sync or reshard.outer:
            return states[reshard.source]
        return tree_mean(states, where=is_float)


def moved_optimizer_state(states: list[dict], reshard: Reshard | None = None) -> dict:
    """A torch optimizer's state for every new worker: the old workers' mean moments (summed in
    rank order, divided once); step counts and param groups are the first's."""
    return tree_mean(states, where=is_float_array)


class RNGState:
    """The process's random generators (torch, CUDA, NumPy, Python) as one stateful object."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)

    @staticmethod
    def resharded_state(states: list[dict], reshard: Reshard) -> dict | None:
        """A rank that existed keeps its generators; a new one its per-rank seed (the one the
        trainer set: None, nothing is restored)."""
        return states[reshard.rank] if reshard.rank < len(states) else None


def _first_state(states: list, reshard: Reshard) -> Any:
    return states[reshard.source]


def mover(component: Any):
    """How `component`'s state moves to another layout: its own `resharded_state`, the mean for
    a torch optimizer, else the state every worker shared."""
    own = getattr(component, "resharded_state", None)
    if own is not None:
        return own
    if isinstance(component, torch.optim.Optimizer):
        return moved_optimizer_state
    return _first_state


def resharded(
    states: list[dict],
    components: Mapping[str, Stateful],
    reshard: Reshard,
    skip: tuple[str, ...] = (),
) -> tuple[dict, tuple[str, ...]]:
    """This rank's state, from the old ranks' `states`, component by component (each moves its
    own, `mover`), and the names of those that keep their own; those in `skip`, and those the
    checkpoint lacks, are left out."""
    merged, kept = {"step": states[reshard.source]["step"]}, []
    for name, component in components.items():
        if name in skip or name not in states[reshard.source]:
            continue
        state = mover(component)([s.get(name) for s in states], reshard)
        if state is None:
            kept.append(name)
        else:
            merged[name] = state
    return merged, tuple(kept)


def restore(
    state: dict, components: Mapping[str, Stateful], optional: tuple[str, ...], folder: str
) -> None:
    """Load each component from its entry of `state`, a rank state read from `folder`; those
    named in `optional` may be absent (e.g. drift, when tracking was off)."""
    for name, component in components.items():
        if name in state:
            component.load_state_dict(state[name])
        elif name not in optional:
            raise ValueError(f"checkpoint {folder} holds no {name!r} state")


# RNG states: the torch generators always; Python's and NumPy's as plain lists and tensors, so the
# file stays loadable with weights_only=True.
def rng_state() -> dict:
    import random

    import numpy as np

    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))

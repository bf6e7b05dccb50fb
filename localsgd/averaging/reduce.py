"""Reducers: how an averager turns the workers' flat buffers into their common value.

An averager decides *when* to average (its schedule) and *who* averages (a `Communicator` per
level); a reducer decides *what* the average is: the plain mean here, the mean of a low-precision
change (`compress.LowPrecisionMean`), an outer optimizer step over it (`outer.OuterStep`), or a
mean applied one step late (`overlap.DelayedMean`).
"""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.flat import Relayout


class Reducer:
    """The plain mean: every buffer replaced in place by its mean over the level's group.

    The contract the averager calls: `reduce_` for a blocking average; for a reducer that
    `delays`, `launch_` at a sync and `finish_` one step later, with `averages` the common values
    received; `reset` after the initial broadcast; `relayout`; `state_dict`/`load_state_dict`.
    """

    delays = False  # True: `launch_` at a sync, `finish_` one step later (see overlap.py)
    pending = False  # a delayed average is in flight
    # Keeps state taken from the replicas (an anchor: compressed changes, an outer optimizer), so
    # replicas that differ when it is built would never meet: the averager broadcasts first.
    anchored = False
    # a delaying reducer's `averages`: what every rank received from the last delayed average
    averages: list[torch.Tensor]

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        for flat in buffers:
            comm.mean_(flat)

    def launch_(self, buffers: list[torch.Tensor], comm: Communicator) -> None:
        """Start averaging `buffers` without waiting (reducers that `delay` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not delay its averages")

    def finish_(self, buffers: list[torch.Tensor]) -> None:
        """Wait for the average launched by `launch_` and apply it to `buffers`."""
        raise NotImplementedError(f"{type(self).__name__} does not delay its averages")

    def reset(self, buffers: list[torch.Tensor]) -> None:
        """Every rank holds the same `buffers` now (after the initial broadcast)."""

    def relayout(self, convert: Relayout) -> None:
        """The buffers were rebuilt in a new layout (a tensor changed dtype or device)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


PlainMean = Reducer

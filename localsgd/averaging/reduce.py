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
    # Whether it can scale this worker's change since the last average before the mean (it
    # holds that average's state): `change_scale`, set by the averager for one weighted round
    # (`Averager.normalized`), is the factor and how many leading elements of each buffer (the
    # parameters) it applies to; None: the change as it is.
    scales_changes = False
    change_scale: tuple[float, list[int]] | None = None

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


def scale_change_(change: torch.Tensor, index: int, scale: tuple[float, list[int]] | None) -> None:
    """Buffer `index`'s change (or pseudo-gradient) times a weighted round's factor, over its
    leading parameters (see `Reducer.change_scale`; float buffers such as BatchNorm's running
    statistics are averaged as they are, never extrapolated)."""
    if scale is not None:
        factor, lead = scale
        change[: lead[index]].mul_(factor)


class RoundStartMean(Reducer):
    """The plain mean that keeps the state every rank held after the last average (`anchors`),
    so a weighted round can scale this worker's change since then (`change_scale`). Without a
    scale it is the plain mean, bit for bit."""

    anchored = True
    scales_changes = True

    def __init__(self, buffers: list[torch.Tensor]):
        self.anchors = [b.detach().clone() for b in buffers]

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        for g, (flat, anchor) in enumerate(zip(buffers, self.anchors, strict=True)):
            if self.change_scale is not None:  # the parameters: anchor + factor x change
                factor, lead = self.change_scale
                part, start = flat[: lead[g]], anchor[: lead[g]]
                part.sub_(start).mul_(factor).add_(start)
            comm.mean_(flat)
            anchor.copy_(flat)

    def reset(self, buffers: list[torch.Tensor]) -> None:
        for anchor, flat in zip(self.anchors, buffers, strict=True):
            anchor.copy_(flat)

    def relayout(self, convert: Relayout) -> None:
        self.anchors = convert(self.anchors)

    def state_dict(self) -> dict:
        return {"anchors": [a.clone() for a in self.anchors]}

    def load_state_dict(self, state: dict) -> None:
        for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
            anchor.copy_(saved)

"""Plain local SGD over untrusted workers: the changes since the last sync aggregated by a
`trust.TrustedRound` instead of the all-reduced mean (`PeriodicAverager(aggregate=...)`)."""

from __future__ import annotations

import torch

from localsgd.averaging.comm import Communicator
from localsgd.averaging.compress import LowPrecisionMean
from localsgd.averaging.flat import FlatBuffers, Relayout
from localsgd.averaging.robust import Aggregate
from localsgd.averaging.trust import Judge, TrustedRound


class RobustMean(LowPrecisionMean):
    """Plain local SGD over untrusted workers: each sync aggregates the changes since the last
    sync (`local - anchor`; every rank holds the same anchor, the model after the last sync) by
    a `TrustedRound`, and every rank continues from `anchor + aggregate`. `dtype` carries the
    changes (float32: as they are; see `compress.comm_dtype_of`); `error_feedback` as in
    `LowPrecisionMean`."""

    def __init__(
        self,
        buffers: list[torch.Tensor],
        dtype,
        size: int,
        aggregate: Aggregate,
        judge: Judge | None = None,
        error_feedback: bool = False,
        feedback_decay: float = 1.0,
        mirror: FlatBuffers | None = None,
    ):
        super().__init__(buffers, dtype, levels=1, error_feedback=error_feedback,
                         feedback_decay=feedback_decay)
        self.trust = TrustedRound(
            buffers, size, self.low, aggregate, judge, 1, feedback_decay, mirror=mirror
        )

    def reduce_(self, buffers: list[torch.Tensor], comm: Communicator, level: int, step: int):
        anchors = self.anchors[0]
        for flat, anchor in zip(buffers, anchors, strict=True):
            flat.sub_(anchor)
        self.trust.run_(buffers, anchors, comm, self.residuals, step)
        for flat, anchor in zip(buffers, anchors, strict=True):
            flat.add_(anchor)
            anchor.copy_(flat)

    def relayout(self, convert: Relayout) -> None:
        raise ValueError(
            "a parameter changed dtype or device under a robust aggregate: move the model "
            "(model.to(...)) before building the averager"
        )

    def state_dict(self) -> dict:
        return {**super().state_dict(), "trust": self.trust.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.trust.load_state_dict(state.get("trust", {}))

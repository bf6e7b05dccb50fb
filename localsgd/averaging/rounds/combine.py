"""The transport and combine stages: every worker's contribution to one part, combined.

- `Mean`: the mean, all-reduced in the wire's format (16/32 bits), or, for low-bit and top-k
  messages, all-gathered and decoded in rank order (`wire.Wire`); a contribution that holds
  NaN/Inf is dropped in band (`localsgd.averaging.finite`); a weighted round's shares are the
  communicator's (`Communicator.weigh`);
- `Gathered`: every contribution gathered, then dropped when not finite, scored by a judge and
  combined by a robust rule (`localsgd.averaging.trust.trusted_round.TrustedRound`: clip, trimmed
  mean, median,
  sign, or the gathered mean). One verdict state serves every part: a worker is one worker
  whichever part it sends, so an exclusion holds for all of them.

Both run blocking, or launched at one step and finished at a later one (a delayed merge): the
launched gather's rows are judged and combined when the round is finished.
"""

from __future__ import annotations

from dataclasses import replace

from localsgd.averaging.comm import Communicator
from localsgd.averaging.rounds.part import Tensors
from localsgd.averaging.rounds.wire import Wire
from localsgd.averaging.trust.robust import Aggregate, GatheredContributions
from localsgd.averaging.trust.trusted_round import Judge, TrustedRound


class Mean:
    """The (weighted) mean, through each part's wire."""

    gathered = False

    def blocking(self, p: int, work: Tensors, comm: Communicator, wire: Wire, **_) -> None:
        wire.mean_(work, comm)

    def launch(self, p: int, work: Tensors, comm: Communicator, wire: Wire):
        return wire.launch_mean(work, comm)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Gathered:
    """Gathered contributions judged and combined robustly (see the module doc). `shapes[p]`:
    tensors shaped as part p's work; `sign`: a candidate is `anchor + sign * contribution`;
    `mirror`: sharded parameters' `FlatBuffers` (`TrustedRound`)."""

    gathered = True

    def __init__(
        self,
        shapes: list[Tensors],
        size: int,
        wires: list[Wire],
        aggregate: Aggregate,
        judge: Judge | None = None,
        sign: int = 1,
        mirror=None,
    ):
        if judge is not None and len(shapes) > 1:  # probation counts each part's first rounds
            judge = replace(judge, probation_rounds=judge.probation_rounds * len(shapes))
        decay = wires[0].decay
        self.trust = TrustedRound(
            shapes[0], size, wires[0].low, aggregate, judge, sign, decay, mirror=mirror
        )
        self.gathered_by_part = [self.trust.contributions] + [
            GatheredContributions(s, size, w.low, decay)
            for s, w in zip(shapes[1:], wires[1:], strict=True)
        ]

    @property
    def judges(self) -> bool:
        return self.trust.judge is not None

    def blocking(
        self,
        p: int,
        work: Tensors,
        comm: Communicator,
        wire: Wire,
        anchors: Tensors | None = None,
        step: int = 0,
    ) -> None:
        """`work` holds this rank's contribution (in place in the model, for a judge, which
        evaluates candidates there); it receives the combined one."""
        self.trust.run_(work, anchors, comm, wire.residuals, step, self.gathered_by_part[p])

    def launch(self, p: int, work: Tensors, comm: Communicator, wire: Wire):
        return self.gathered_by_part[p].launch_gather_(work, comm, wire.residuals)

    def finish(
        self,
        p: int,
        work: Tensors,
        comm: Communicator,
        anchors: Tensors | None = None,
        step: int = 0,
        model: Tensors | None = None,
    ) -> None:
        """The launched gather's rows judged and combined into `work`; a judge evaluates the
        candidates in `model` (the part's views of the buffers), which the caller restores."""
        self.trust.settle_(
            work if model is None else model, anchors, comm, step, self.gathered_by_part[p]
        )
        if model is not None:
            for w, m in zip(work, model, strict=True):
                w.copy_(m)

    def state_dict(self) -> dict:
        return {"trust": self.trust.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.trust.load_state_dict(state.get("trust", {}))

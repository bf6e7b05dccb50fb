"""The adaptive period (`sync.schedule=adaptive`, `schedule.AdaptivePeriod`) in asynchronous
rounds: decided by the syncer from the losses the workers report with their contributions, and
sent back in every answer (`FleetPeriod`).

The synchronous rounds decide once a round, from the mean over the workers of each one's mean
training loss since the last decision. Asynchronous rounds have no round every worker takes part
in, so the syncer decides once per round's worth of contributions: after every `workers x parts`
contributions merged (each worker's model once, or each of its P fragments once), from the mean
over the workers that reported of each one's mean loss since the last decision (its losses
weighed by the steps behind them; their median under a robust `sync.aggregate`, so that no
one worker's report sets everyone's period, as the synchronous rounds agree on it under their
rule). A worker that computes fewer steps (a slow one) weighs as
much as a fast one, as in a synchronous round. With every worker equally fast and a quorum of
all, every merge is a synchronous round of every worker and the decisions are the synchronous
rounds' own.

A meeting (a checkpoint) is not a round of the synchronous schedule: its contributions' losses
join the window in progress, but they do not count towards the next decision, which a
meeting's few steps since the last phase would otherwise take early and on a noisy loss.

A worker takes the period from each answer: a phase by steps ends once that many steps have
passed since its last one (`phases.PhaseGrid`, `PeriodicAverager`'s rule), so a decision
reaches each worker at its next exchange, as the newest global model does.
"""

from __future__ import annotations

import math
import statistics

from localsgd.averaging.schedule import AdaptivePeriod

RULE_SETTINGS = ("period", "min_period", "max_period", "factor", "tolerance")


class FleetPeriod:
    """The syncer's adaptive period: `rule` (the run's `AdaptivePeriod`, its settings and start;
    its loss slot unused) decided after every `workers x parts` contributions; `robust`: from
    the median of the workers' losses, not their mean."""

    def __init__(self, rule: AdaptivePeriod, workers: int, parts: int = 1, robust: bool = False):
        self.rule, self.robust = rule, robust
        self.per_decision = workers * parts
        self.losses: dict[int, list[float]] = {}  # worker -> [loss x steps, steps] since
        self.contributions = 0  # ... the last decision, and the contributions merged since
        self.decisions = 0

    @classmethod
    def settings_of(cls, schedule, workers: int, parts: int, robust: bool) -> dict | None:
        """What the syncer's rule is built from (json, for a hosted syncer too): None where the
        worker's `schedule` does not adapt."""
        if not isinstance(schedule, AdaptivePeriod):
            return None
        rule = {k: getattr(schedule, k) for k in RULE_SETTINGS}
        return {"rule": rule, "workers": workers, "parts": parts, "robust": robust}

    @classmethod
    def build(cls, settings: dict | None) -> FleetPeriod | None:
        if settings is None:
            return None
        rule = AdaptivePeriod(**settings["rule"])
        return cls(rule, settings["workers"], settings["parts"], settings["robust"])

    @property
    def period(self) -> int:
        return self.rule.period

    def merged(self, reports: list[tuple[int, list[float] | None, int]]) -> None:
        """Contributions merged (or all-reduced): per sender, its `[mean loss, steps]` since its
        last exchange (None: none observed) and how many contributions (fragments) it sent."""
        for worker, loss, count in reports:
            self.contributions += count
            if loss is None or not math.isfinite(loss[0]) or loss[1] <= 0:
                continue
            held = self.losses.setdefault(worker, [0.0, 0.0])
            held[0] += loss[0] * loss[1]
            held[1] += loss[1]
        if self.contributions < self.per_decision:
            return
        means = [total / steps for total, steps in self.losses.values() if steps > 0]
        if not means:
            loss = None
        elif self.robust:
            loss = statistics.median(means)
        else:
            loss = sum(means) / len(means)
        self.rule.update(loss)
        self.losses, self.contributions = {}, 0
        self.decisions += loss is not None

    def state_dict(self) -> dict:
        return {
            "rule": self.rule.state_dict(),
            "losses": {str(w): list(v) for w, v in self.losses.items()},
            "contributions": self.contributions,
            "decisions": self.decisions,
        }

    def load_state_dict(self, state: dict) -> None:
        rule = {k: v for k, v in state["rule"].items() if k != "loss_slot"}
        self.rule.load_state_dict(rule)
        self.losses = {int(w): [float(x) for x in v] for w, v in state["losses"].items()}
        self.contributions = int(state["contributions"])
        self.decisions = int(state["decisions"])

"""`trainer.keep_best`: the weights of the best evaluation so far, by the validation metric.

At each periodic evaluation (and the final one) rank 0 compares the run's `optimized_metric`, a
`val_*` key, with the best so far (lower is better for a loss or perplexity, higher otherwise)
and, where it improved, writes the model's weights to `best.pt` (atomically, a plain state_dict
like `model.pt`) and `best.json` ({step, metric, value}). A resumed run reads `best.json` back,
so the best of a run is the best over its whole length; a deterministic run redoes the same
evaluations after a resume, and a tie keeps the earlier weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

BEST_WEIGHTS, BEST_RECORD = "best.pt", "best.json"
LOWER_IS_BETTER = ("loss", "perplexity")


class KeepBest:
    def __init__(self, run_dir: str, metric: str, enabled: bool):
        self.run_dir = run_dir
        self.metric = metric
        self.enabled = enabled
        self.lower = any(word in metric for word in LOWER_IS_BETTER)
        self.record: dict[str, Any] | None = None
        path = os.path.join(run_dir, BEST_RECORD)
        if enabled and os.path.isfile(path):  # a resumed run: the best before the stop counts
            with open(path, encoding="utf-8") as f:
                self.record = json.load(f)

    def better(self, value: float) -> bool:
        if self.record is None:
            return True
        best = self.record["value"]
        return value < best if self.lower else value > best

    def observe(self, step: int, evaluation: dict[str, float], model: torch.nn.Module) -> None:
        """After an evaluation of `model` at `step` (rank 0): keep its weights if they are the
        best so far by the metric."""
        value = evaluation.get(self.metric)
        if not self.enabled or value is None or not self.better(float(value)):
            return
        state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        weights = os.path.join(self.run_dir, BEST_WEIGHTS)
        torch.save(state, weights + ".tmp")
        os.replace(weights + ".tmp", weights)
        self.record = {"step": step, "metric": self.metric, "value": float(value)}
        record = os.path.join(self.run_dir, BEST_RECORD)
        with open(record + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.record, f)
        os.replace(record + ".tmp", record)

    def summary(self) -> dict[str, Any]:
        """summary.json's `best`: {step, metric, value, file}, when kept."""
        if not self.enabled or self.record is None:
            return {}
        return {"best": {**self.record, "file": BEST_WEIGHTS}}

"""A trainer callback for the tests: `StepTimes(path=DIR)` appends each step's start (its
index and the wall time) to DIR/rank{RANK}.txt, so that a test reads when each worker
trained what (nothing in the package knows about it)."""

from __future__ import annotations

import os
import time


class StepTimes:
    def __init__(self, path: str):
        self.path = path

    def on_step_start(self, trainer, step: int) -> None:
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"rank{trainer.info.rank}.txt"), "a") as f:
            f.write(f"{step} {time.time():.4f}\n")


def read(path: str, rank: int) -> list[tuple[int, float]]:
    """The (step, wall time) of each step worker `rank` started, in order."""
    with open(os.path.join(path, f"rank{rank}.txt")) as f:
        return [(int(a), float(b)) for a, b in (line.split() for line in f)]

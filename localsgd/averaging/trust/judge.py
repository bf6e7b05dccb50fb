"""The judge of untrusted contributions (`localsgd.averaging.trust.trusted_round`): its settings
and the paired test its verdicts rest on. `TrustedRound` asks it; it holds no state of its own."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Judge:
    """Scores contributions and excludes workers (see the module doc). `loss_at(round)`: the
    loss of the model as it stands now on round `round`'s held-out batch, drawn from the round's
    seed, the same on every rank: per sample (a 1-D tensor), or one float (then no paired test
    can be made, and `score_z` is not used). `exclude_after` = 0: score and drop, never
    exclude. `split_evaluation`: each contribution's losses are evaluated by one rank of the
    group and all-gathered (about 1/size of the forward passes each, one small collective
    more); False: every rank evaluates every contribution, with no communication.
    `batch`: the held-out batch's length; given, `loss_at(round, samples)` must also take a
    slice of it and evaluate only those samples, and the group splits each evaluation by
    samples instead (`held_out`: at 4 ranks each runs half the forward passes it would by
    candidate).
    `exclude_window` = W: a worker is also excluded once `exclude_after` of its last W judged
    rounds were bad (an attacker bad every other round never runs up a streak); every round it
    is scored in counts, bad or not.
    `probation_rounds` = P: in a worker's first P rounds, min(2, `exclude_after`) bad rounds
    running exclude it (a newcomer has shown nothing yet; see the module doc of `trust`)."""

    loss_at: Callable[..., float | torch.Tensor]
    exclude_after: int = 3
    score_fraction: float = 0.5
    score_z: float = 3.0
    split_evaluation: bool = True
    exclude_window: int | None = None
    probation_rounds: int = 3
    batch: int | None = None

    def __post_init__(self):
        if self.batch is not None and not self.batch >= 1:
            raise ValueError(f"batch must be None or an integer >= 1, got {self.batch!r}")
        if self.exclude_window is not None and self.exclude_window < self.exclude_after:
            raise ValueError(
                f"exclude_window must be None or >= exclude_after ({self.exclude_after}), got "
                f"{self.exclude_window!r}"
            )
        if not self.score_z >= 0:
            raise ValueError(f"score_z must be >= 0, got {self.score_z!r}")
        if self.probation_rounds < 0:
            raise ValueError(f"probation_rounds must be >= 0, got {self.probation_rounds!r}")
        if self.exclude_after < 0:
            raise ValueError(f"exclude_after must be >= 0, got {self.exclude_after!r}")
        if not 0 <= self.score_fraction < 1:
            raise ValueError(f"score_fraction must be in [0, 1), got {self.score_fraction!r}")


def per_sample(loss: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(loss, dtype=torch.float64).reshape(-1)


def paired_z(losses: torch.Tensor, reference: torch.Tensor) -> float | None:
    """How many standard errors of their paired differences `losses` exceed `reference` by
    (negative: below it; None: not finite, or one sample, which tells no spread)."""
    diff = losses - reference
    if diff.numel() < 2:
        return None
    gap, spread = float(diff.mean()), float(diff.std()) / math.sqrt(diff.numel())
    z = gap / spread if spread > 0 else math.copysign(math.inf, gap) if gap else 0.0
    return z if math.isfinite(z) else None


def worse(losses: torch.Tensor, reference: torch.Tensor, z: float) -> bool:
    """Whether `losses` exceed `reference` by more than `z` standard errors of their paired
    differences (one sample: by anything at all)."""
    diff = losses - reference
    gap = float(diff.mean())
    if diff.numel() < 2:
        return gap > 0
    return gap > z * float(diff.std()) / math.sqrt(diff.numel())

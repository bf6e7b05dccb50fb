"""Model averaging for local SGD, usable on its own like torch's averagers (no Hydra, no wandb)."""

from localsgd.averaging.comm import CommStats, SimulatedLink, all_reduce_mean_
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.gradients import GradientAverager
from localsgd.averaging.periodic import PeriodicAverager

__all__ = [
    "CommStats",
    "FlatBuffers",
    "GradientAverager",
    "PeriodicAverager",
    "SimulatedLink",
    "all_reduce_mean_",
    "averaged_tensors",
]

"""Model averaging for local SGD, usable on its own like torch's averagers (no Hydra, no wandb)."""

from localsgd.averaging.comm import CommStats, SimulatedLink, all_reduce_mean_
from localsgd.averaging.compress import COMM_DTYPES, LowPrecisionMean
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.gradients import GradientAverager
from localsgd.averaging.hierarchical import HierarchicalAverager
from localsgd.averaging.optimizer_state import OPTIMIZER_STATE_MODES, OptimizerStateSync
from localsgd.averaging.outer import OUTER_DEFAULTS, OuterAverager
from localsgd.averaging.periodic import PeriodicAverager
from localsgd.averaging.schedule import AdaptivePeriod, ConstantPeriod, StepPeriod

__all__ = [
    "COMM_DTYPES",
    "OPTIMIZER_STATE_MODES",
    "OUTER_DEFAULTS",
    "AdaptivePeriod",
    "CommStats",
    "ConstantPeriod",
    "FlatBuffers",
    "GradientAverager",
    "HierarchicalAverager",
    "LowPrecisionMean",
    "OptimizerStateSync",
    "OuterAverager",
    "PeriodicAverager",
    "SimulatedLink",
    "StepPeriod",
    "all_reduce_mean_",
    "averaged_tensors",
]

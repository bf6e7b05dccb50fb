"""Model averaging for local SGD, usable on its own like torch's averagers (no Hydra, no wandb).

`PeriodicAverager` and `HierarchicalAverager` take torch's signatures and are instances of
torch's `ModelAverager`; `OuterAverager` adds DiLoCo/SlowMo. Every collective goes through a
`Communicator`.

The core (this folder) holds the averagers, the flat buffers, the communicator and the
schedules; every sync round runs through one pipeline of stages (`rounds/`). The features are
wings around it, each a folder: `wire/` (low-bit and sparse formats, error feedback), `trust/`
(robust combine rules, scoring, trusted rounds), `streaming/` (Streaming DiLoCo's fragments),
`torchft/` (rounds across replica groups through torchft) and `asynchronous/` (outer rounds
without the barrier: workers on their own clocks and a syncer).
"""

from localsgd.averaging.averager import Averager
from localsgd.averaging.comm import CommStats, Communicator, SimulatedLink
from localsgd.averaging.flat import FlatBuffers, averaged_tensors
from localsgd.averaging.gradients import GradientAverager
from localsgd.averaging.hierarchical import HierarchicalAverager
from localsgd.averaging.optimizer_state import OPTIMIZER_STATE_MODES, OptimizerStateSync
from localsgd.averaging.outer import OuterAverager
from localsgd.averaging.periodic import PeriodicAverager
from localsgd.averaging.rounds import OUTER_DEFAULTS, Rounds
from localsgd.averaging.schedule import AdaptivePeriod, ConstantPeriod, NeverAverage, StepPeriod
from localsgd.averaging.streaming.averager import StreamingAverager
from localsgd.averaging.trust.robust import AGGREGATES, Aggregate
from localsgd.averaging.trust.trusted_round import Judge, TrustedRound
from localsgd.averaging.wire.compress import COMM_DTYPES
from localsgd.averaging.wire.quantize import QUANTIZED_FORMATS, BlockCodec, QuantizedWire
from localsgd.averaging.wire.sparse import SparseWire, TopKCodec

__all__ = [
    "AGGREGATES",
    "COMM_DTYPES",
    "OPTIMIZER_STATE_MODES",
    "OUTER_DEFAULTS",
    "QUANTIZED_FORMATS",
    "AdaptivePeriod",
    "Aggregate",
    "Averager",
    "BlockCodec",
    "CommStats",
    "Communicator",
    "ConstantPeriod",
    "FlatBuffers",
    "GradientAverager",
    "HierarchicalAverager",
    "Judge",
    "NeverAverage",
    "OptimizerStateSync",
    "OuterAverager",
    "PeriodicAverager",
    "QuantizedWire",
    "Rounds",
    "SimulatedLink",
    "SparseWire",
    "StepPeriod",
    "StreamingAverager",
    "TrustedRound",
    "TopKCodec",
    "averaged_tensors",
]

"""Averaging across replica groups through torchft, so that workers may die and rejoin.

- `comm.TorchftCommunicator`: the widest level of an averager, across replica groups;
- `rounds.FaultTolerantRounds`: each sync across groups as a torchft round (quorum, heal,
  commit or put back);
- `grace.GraceWindow`: how long a round's collectives wait for a peer that stopped answering;
- `heartbeat_gate.HeartbeatGate`: a worker heartbeats to the lighthouse only while it is healthy,
  so one cut off from its peers drops out of their next quorum (`GatedHeartbeats`, its thread);
- `services`: torchft's lighthouse and Manager, every server bound to one interface.
- `gathered`: what a round gathers across replica groups (low-bit messages, trusted
  contributions, a weighted round's weights).

Importing this package imports no torchft module: its functions import torchft when called, so
a run without fault tolerance never loads it.
"""

from localsgd.averaging.torchft.comm import QuorumLost, TorchftCommunicator
from localsgd.averaging.torchft.grace import GraceWindow
from localsgd.averaging.torchft.rounds import (
    FaultTolerantRounds,
    ReplicaGroupsDiverged,
    attach,
    without_residuals,
)
from localsgd.averaging.torchft.services import lighthouse_url, make_manager, start_lighthouse

__all__ = [
    "FaultTolerantRounds",
    "GraceWindow",
    "QuorumLost",
    "ReplicaGroupsDiverged",
    "TorchftCommunicator",
    "attach",
    "lighthouse_url",
    "make_manager",
    "start_lighthouse",
    "without_residuals",
]

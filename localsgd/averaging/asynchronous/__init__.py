"""Asynchronous outer rounds (`sync.mode=async`): workers on their own clocks.

- `averager`: `AsyncAverager`, each worker's side: when its phase ends, send the pseudo-gradient
  and take the newest global model back;
- `service`: `SyncerService`, the syncer's thread on rank 0: the order of the messages, the
  quorum and grace window;
- `syncer`: `Syncer`, the global model, its outer optimizer and the pending contributions;
- `synchronous_rounds`: where every worker sends at once (or, on the wall clock, within the
  grace window), a synchronous round's all-reduce instead of point-to-point exchanges;
- `pacing`: `Pacing`, the wall clock's rules: who a merge waits for, and where a worker out of
  step with the others ends its next phase;
- `clock`: the modelled clock, which ticks a slower worker computes;
- `phases`: `PhaseGrid`, where a phase by steps ends (the synchronous rounds' rule, constant or
  a step schedule);
- `fleet_period`: `FleetPeriod`, the adaptive period (`sync.schedule=adaptive`), decided by the
  syncer from the losses the workers report and sent back in its answers;
- `delayed_nesterov`: `DelayedNesterov`, the staleness-aware outer step;
- `heloco`: `HeLoCo`, the optional correction of each stale pseudo-gradient against the outer
  momentum before it is merged;
- `in_flight`: exchanges in flight (`sync.overlap`, `sync.delay_steps`): a worker trains on
  while its exchange runs, and its answer lands a step or more later;
- `messages`: a contribution in the wire's format (encoded by the worker, decoded by the syncer);
- `mailbox`: `Mailbox`, messages through the rendezvous store;
- `links`: how a worker and the syncer reach each other: one world, or sessions with a hosted
  syncer;
- `hosted`: `HostedSyncer`, the syncer in a process that trains nothing (the launcher, under
  `ft=torchft`), where workers die, restart and rejoin;
- `rejoin`: a worker's sessions with a hosted syncer: its first, and a new one after a failure.
"""

from localsgd.averaging.asynchronous.averager import AsyncAverager
from localsgd.averaging.asynchronous.delayed_nesterov import DelayedNesterov
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.asynchronous.hosted import HostedSyncer
from localsgd.averaging.asynchronous.syncer import Syncer

__all__ = ["AsyncAverager", "DelayedNesterov", "HeLoCo", "HostedSyncer", "Syncer"]

"""The round driver of asynchronous rounds under `ft=torchft` (`AsyncSessions`): every worker a
process of its own, restarted by the launcher when it dies, the syncer hosted by the launcher
(`localsgd.averaging.asynchronous.hosted`).

Asynchronous rounds need no quorum (the syncer merges whoever has sent), so torchft's Manager
has no round to run here: the launcher restarts what dies, and a worker reaches the syncer
through sessions it opens itself. What each piece does:

- **A worker's first step.** It joins the syncer and takes the global model. After a restart
  it also takes the state its process had when its last contribution arrived: the step, the
  loop's counters and the data position (each contribution carries them, as json), so it goes
  on from there. Its inner optimizer's state starts afresh, and its random generators are
  reseeded for the new attempt (as a torchft heal does), so that no two workers draw alike.
- **What a death costs.** The training since the dead worker's last contribution: those samples
  were never merged (`merged_samples` counts what was). Nobody else waits for it.
- **Meetings.** Every checkpoint step (`trainer.checkpoint_every`) and the last step are
  meetings of every worker the launcher has not given up on (one transfer's deadline at most
  for one behind): every worker there leaves with the global model, and the first one there
  writes the checkpoint, with the syncer's state, which the syncer sends it; at the last, the
  results (`async_writer`), with the syncer's record (`merged_samples`, merges, sessions).
- **A stop** (SIGTERM, Ctrl-C) is asked for at the next meeting and agreed there: whoever is
  at it stops after the checkpoint, and a worker behind is told to stop when it next talks.
  A resumed run's syncer goes on from the state the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from localsgd.averaging.checksum import replica_checksum
from localsgd.averaging.trees import tree_as_json, tree_from_json
from localsgd.loop.guards import ReplicasDiverged
from localsgd.loop.local_rounds import LocalRounds
from localsgd.loop.metrics import notice
from localsgd.loop.stop import StopAgreement, signalled


class AsyncSessions(LocalRounds):
    """`LocalRounds` (the averager's exchanges are its own) with the start, the writer and the
    checkpoints of a hosted syncer (see the module doc). `seed`, `attempt`: the reseeding."""

    shared_checkpoints = True  # after a meeting every worker there holds the global model
    checks_inside = True  # each worker against the syncer's model: `maybe_average`

    def __init__(self, averager, worker: int, seed: int, attempt: int, verify: bool = False):
        super().__init__(averager, None)
        self._worker, self.seed, self.attempt = worker, seed, attempt
        self.resumed_at: int | None = None  # the step a restarted process went on from
        self.verify, self.checked, self.seen = verify, 0, 0
        averager.stop_requested = signalled  # a meeting stops the run if anyone there asks

    def maybe_average(self) -> None:
        """The averager's exchange; after a meeting, with `sync.check_replicas`, this worker's
        model checked against the syncer's global model (its checksum, sent with the meeting's
        answer): every worker there holds it bit for bit, or the run fails. There is no world
        of workers to gather in: each is a world of its own."""
        averager = self.averager
        averager.maybe_average()
        if averager.meetings == self.seen:
            return
        self.seen = averager.meetings
        if not self.verify:
            return
        held = replica_checksum(averager.common_tensors()).tolist()
        if held != averager.meeting["checksum"]:
            raise ReplicasDiverged(
                f"worker {self._worker} does not hold the syncer's global model after the "
                f"meeting at step {averager.step - 1} (sync.check_replicas=true)"
            )
        self.checked += 1

    @property
    def replica_checks(self) -> int:
        return self.checked

    def join(
        self, registry: Mapping[str, Any], optimizer_step: Callable[[], None], step: int, every: int
    ) -> str:
        averager = self.averager
        averager.resume_state = lambda: _json(
            {"loop": registry["loop"].state_dict(), "sampler": registry["sampler"].state_dict()}
        )
        welcome = averager.connect() or {}
        resume = _tensors(welcome.get("resume"))
        if resume is not None and self.attempt > 0:
            loop = dict(resume["loop"])
            # the contribution was sent inside its step: the process goes on with the next one;
            # the seconds since it arrived count as training time (the job's clock ran on)
            loop["step"] = int(loop["step"]) + 1
            loop["elapsed_s"] = float(loop["elapsed_s"]) + float(welcome["since_s"] or 0.0)
            registry["loop"].load_state_dict(loop)
            registry["sampler"].load_state_dict(resume["sampler"])
            averager.step = loop["step"]
            self.resumed_at = loop["step"]
            notice(
                f"ft: worker {self._worker} rejoined the syncer; it trains on from step "
                f"{loop['step']}, after its last contribution that arrived"
            )
        if self.attempt > 0:
            torch.manual_seed(self.seed + 1000 * self._worker + 1 + 7919 * self.attempt)
        return "fresh"

    @property
    def worker(self) -> int:
        return self._worker

    @property
    def speaks(self) -> bool:
        return self._worker == 0

    def writes_results(self, rank: int) -> bool:
        """The first worker at the last meeting (worker 0 unless the launcher lost it)."""
        return self.averager.final_record.get("async_writer", 0) == self._worker

    def evaluates_final(self, rank: int, sharding) -> bool:
        return self.writes_results(rank)

    def checkpoint(
        self, step: int, max_steps: int, every: int, stop: StopAgreement, save, final: bool,
        save_shared: Callable[[bool], str], **_,
    ) -> bool:  # fmt: skip
        """At a meeting, by the worker the syncer names (see the module doc); True to stop
        there (agreed at the meeting), or when the run ended while this worker was behind."""
        averager = self.averager
        if final:
            return False
        if averager.stopped:
            return True
        if not averager.met_at(step - 1):
            return False
        stopping = bool(averager.meeting["stop"]) and step < max_steps
        if stopping or (every > 0 and (step % every == 0 or step == max_steps)):
            save_shared(averager.meeting["writer"] == self._worker)
        return stopping

    def summary(self) -> dict[str, Any]:
        return {} if self.resumed_at is None else {"async_resumed_at": self.resumed_at}


def _json(state: Any) -> Any:
    """`state` as a message, which is json: `trees.tree_as_json`'s layout, the tensors' values
    inline (the loop's and the sampler's state are small)."""
    packed, tensors = tree_as_json(state)
    return {"tree": packed, "values": [t.reshape(-1).tolist() for t in tensors]}


def _tensors(message: Any) -> Any:
    """`_json`'s inverse (tensors on the host); None stays None."""
    if message is None:
        return None
    values = iter(message["values"])
    return tree_from_json(
        message["tree"], lambda t: t.copy_(torch.tensor(next(values), dtype=t.dtype).view(t.shape))
    )

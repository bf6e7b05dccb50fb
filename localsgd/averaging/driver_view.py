"""What a round driver asks an averager about each step (`localsgd.loop.local_rounds`, torchft's
`FaultTolerantRounds`, the replica checks): whether the step syncs, launches or merges across every
rank, what every rank holds identically after it, and the collectives still in flight.
"""

from __future__ import annotations

import torch

from localsgd.averaging.rounds.part import views

__all__ = ["RoundDriverView"]


class RoundDriverView:
    """The driver's half of `Averager` (a mixin: it reads the averager's rule, `rounds`, `flat`
    and merge state)."""

    def averages_all(self, step: int) -> bool:
        """Whether the update after step `step` starts a round over every rank."""
        at = self.round_at(step)
        return at is not None and at[1] == len(self.levels) - 1

    rounds_overlap = False  # one step closes a round and opens the next (see StreamingAverager)

    @property
    def delayed_syncs(self) -> bool:
        """Whether a sync over every rank is launched after one step and merged after a later
        one (`sync_at` says "launch", then "merge"), rather than done within one step."""
        return self.delay > 0

    def sync_at(self, step: int) -> str | None:
        """What the update after step `step` does across every rank: None (nothing, or an
        inner level's average), "sync" (a blocking round), "launch" (a delayed one opens) or
        "merge" (one launched earlier closes). A round driver (torchft's) runs a round around
        each."""
        if self.delay:
            rounds = self.rounds
            if any(
                rounds.holding[q] and rounds.pending_step[q] == step - self.delay
                for q in range(self.parts)
            ):
                return "merge"
            return "launch" if self.averages_all(step) else None
        return "sync" if self.averages_all(step) else None

    def computes(self) -> bool:
        """Whether this worker trains the next tick (every tick: asynchronous rounds' modelled
        clock idles a slower worker's, `localsgd.averaging.asynchronous.clock`)."""
        return True

    @property
    def in_warmup(self) -> bool:
        """True while the next optimizer step belongs to the synchronous warmup."""
        return self.step < self.warmup_steps

    def common_tensors(self) -> list[torch.Tensor]:
        """Flat tensors every rank holds identically right now: the buffers after a full
        average; after a merge, what every rank received (the anchors with an outer step, the
        part's values under a replacing merge, else the mean received)."""
        if self.all_in_sync or not self.merged:
            return self._bound().current()  # mirror, between steps: a transient copy
        rounds, p = self.rounds, self.last_part
        if rounds.eager:
            return list(rounds.received[p])
        if rounds.anchored:
            out = list(rounds.anchors.first)
        elif rounds.in_place:
            out = []
        else:
            out = list(self.received_mean if self.received_mean is not None else rounds.sent[p])
        if self._replaces:
            current = self.flat.current()  # mirror, between steps: a transient copy
            out += views(current, rounds.parts[p])
        return out

    received_mean: list[torch.Tensor] | None = None  # a relaunched part's mean (StreamingAverager)

    def launched_received(self, step: int) -> list[torch.Tensor]:
        """What every rank received in the launched round that merges after step `step`
        (waited for): the same on every rank, before the merge applies it."""
        rounds = self.rounds
        for q in range(self.parts):
            if rounds.holding[q] and rounds.pending_step[q] == step - self.delay:
                rounds.wait(q)
                return rounds.received_in(q)
        return []

    def complete_launched(self) -> None:
        """Wait for the collectives this averager launched and left in flight (a delayed
        round's, an eager one's); a round driver calls it before closing a round, whose
        process group may not outlive it."""
        self.rounds.wait_all()

    def global_state(self) -> list[torch.Tensor] | None:
        """Between syncs, flat tensors (laid out as the flat buffers) that every rank holds
        identically and that training can continue from, losing only the local progress since
        (a checkpoint of it: `Synchroniser.checkpoint`); None where there are none (the replicas
        are together only right after a sync)."""
        return None

"""A worker's data: its shard of the train set, its batch stream, and an excluded worker's
shard taken over by the others (`sync.excluded_shard=reassign|take_over`).

`worker_batches` cuts this worker's shard (`data.partition`) and streams it (`ShardSampler`,
exactly resumable).

Scoring (`sync.score`, `localsgd.averaging.trust.trusted_round`) excludes a worker for good: it
still trains
and takes part in the collectives, but its contributions never reach the aggregate, and neither
does what it learns from its shard. With `sync.excluded_shard=skip` that part of the data is
lost to the run; with `reassign` (the default under scoring), after the sync that excluded it,
the workers that
remain split its shard between them: the i-th of the `h` remaining workers (in rank order) adds
every h-th index of it, starting at the i-th, to its own shard, from a new epoch of its
sampler. With `take_over` they also take its share of the global batch: the `e * b` samples a
step of the `e` excluded workers' batches of `b` are split as evenly as they go (the first
`e * b mod h` remaining workers one more), so the honest workers train on as many samples a
step as the whole group did, and the learning rate tuned for that batch still fits; each
step then costs them about `(h + e) / h` times the compute. With `reassign` each keeps its own batch
and the run trains on `e` workers' samples a step fewer. The verdicts are identical on every
rank, and so is this split. The sampler's checkpoint carries the indices and the batch taken
over, so a resumed run trains on the same ones.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from localsgd.data import ShardSampler, labels_of, make_batches, shard_indices
from localsgd.loop.metrics import notice


def worker_batches(cfg: Any, data: Any, rank: int, world_size: int, device: torch.device):
    """This worker's batch stream over its shard (in memory for tensor sets, else a DataLoader:
    localsgd/data/loader.py), and its `ShardReassignment` (None with
    `sync.excluded_shard=skip`, or without scoring; under ft=torchft it is not used:
    `Synchroniser.moves_shards`). `take_over`: the others take the excluded worker's batch too."""
    shard_of = partial(
        shard_indices,
        labels_of(data.train),
        world_size,
        partition=cfg.data.partition,
        seed=cfg.seed,
        classes_per_worker=cfg.data.classes_per_worker,
        alpha=cfg.data.alpha,
    )
    sampler = ShardSampler(shard_of(rank), cfg.trainer.batch_size, seed=cfg.seed, rank=rank)
    batches = make_batches(data, cfg.data, sampler, device)
    if cfg.sync.excluded_shard == "skip" or not cfg.sync.score:
        return batches, None
    take_batch = cfg.sync.excluded_shard == "take_over"
    batch = cfg.trainer.batch_size if take_batch else None
    return batches, ShardReassignment(shard_of, rank, world_size, batches, rank == 0, batch)


class ShardReassignment:
    """Watches the trust rounds' exclusions after every sync and hands the excluded workers'
    shards to the rest. `shard_of(rank)`: worker `rank`'s shard (sorted train-set indices);
    `batch_size`: every worker's own batch, whose excluded share the others take over with the
    shard (None: they keep their own batches, `reassign`)."""

    def __init__(
        self,
        shard_of: Callable[[int], torch.Tensor],
        rank: int,
        world_size: int,
        batches,
        announce: bool,
        batch_size: int | None = None,
    ):
        self.shard_of = shard_of
        self.rank = rank
        self.world_size = world_size
        self.batches = batches
        self.announce = announce
        self.batch_size = batch_size

    def batches_taken_over(self, excluded: list[int], remaining: list[int]) -> list[int]:
        """Each remaining worker's batch (in rank order) once it takes its share of the excluded
        workers' batches: their sum is the whole group's, `world_size * batch_size`."""
        taken, h = len(excluded) * self.batch_size, len(remaining)
        return [self.batch_size + taken // h + (i < taken % h) for i in range(h)]

    def after_sync(self, trust, step: int) -> None:
        if trust is None:
            return
        excluded = sorted(trust.excluded)
        if excluded == self.batches.sampler.sources or self.rank in trust.excluded:
            return
        remaining = [r for r in range(self.world_size) if r not in trust.excluded]
        mine = remaining.index(self.rank)
        parts = [self.shard_of(x)[mine :: len(remaining)] for x in excluded]
        sizes = None if self.batch_size is None else self.batches_taken_over(excluded, remaining)
        self.batches.reassign(torch.cat(parts), excluded, None if sizes is None else sizes[mine])
        if self.announce:
            names = ", ".join(map(str, excluded))
            workers = ", ".join(map(str, remaining))
            if sizes is None:
                said = f"shard is split among workers {workers}"
            else:
                said = (
                    f"shard and batch are split among workers {workers} (batches of "
                    f"{', '.join(map(str, sizes))})"
                )
            notice(
                f"trust: worker(s) {names}'s {said} from step {step + 1} (sync.excluded_shard="
                f"{'reassign' if sizes is None else 'take_over'})"
            )

"""Per-worker infinite batch stream with an exactly resumable position."""

from __future__ import annotations

import torch

from localsgd.data._seeding import derive_seed

_SAMPLER_STREAM = 3


class ShardSampler:
    """Infinite stream of index batches over one worker's shard; reshuffled every epoch.

    Each epoch's order is a pure function of (seed, rank, epoch), so the state is only the epoch
    and the position in it: a resumed run regenerates the permutation instead of storing it.
    """

    def __init__(self, indices: torch.Tensor, batch_size: int, seed: int, rank: int):
        self.own = torch.as_tensor(indices, dtype=torch.int64).cpu().flatten()
        self.indices = self.own
        # parts of excluded workers' shards this worker took over (`reassign`), and theirs
        self.extra = torch.zeros(0, dtype=torch.int64)
        self.sources: list[int] = []
        n = len(self.indices)
        if batch_size < 1:
            raise ValueError(f"trainer.batch_size must be an integer >= 1, got {batch_size}")
        if batch_size > n:
            raise ValueError(
                f"trainer.batch_size ({batch_size}) is larger than this worker's shard "
                f"({n} samples); lower trainer.batch_size or dist.world_size, use more data, "
                f"or a less skewed data.partition"
            )
        self.batch_size = self.own_batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.epoch = 0
        self.position = 0
        self._perm: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.indices) // self.batch_size

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            g = torch.Generator().manual_seed(
                derive_seed(self.seed, _SAMPLER_STREAM, self.rank, self.epoch)
            )
            self._perm = torch.randperm(len(self.indices), generator=g)
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """The next `batch_size` indices; an epoch's ragged tail is skipped, never padded."""
        if self.position + self.batch_size > len(self.indices):
            self.epoch += 1
            self.position = 0
            self._perm = None
        chosen = self._permutation()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.indices[chosen]

    def reassign(
        self, extra: torch.Tensor, sources: list[int], batch_size: int | None = None
    ) -> None:
        """Train on this worker's shard plus `extra` (its parts of the shards of the excluded
        workers `sources`, replacing any taken over before), from a new epoch that starts now;
        `batch_size`: its batches from then on (None: its own, as before the reassignment)."""
        extra = torch.as_tensor(extra, dtype=torch.int64).cpu().flatten()
        batch_size = self.own_batch_size if batch_size is None else int(batch_size)
        if not 1 <= batch_size <= len(self.own) + len(extra):
            raise ValueError(
                f"a batch of {batch_size} does not fit a shard of {len(self.own) + len(extra)} "
                "samples"
            )
        self.extra = extra
        self.sources = sorted(int(s) for s in sources)
        self.indices = torch.cat([self.own, self.extra])
        self.batch_size = batch_size
        self.epoch += 1
        self.position = 0
        self._perm = None

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "position": self.position, "num_indices": len(self.own)}
        if self.sources:
            state.update(extra=self.extra.clone(), sources=list(self.sources))
        if self.batch_size != self.own_batch_size:  # taken over with the shard (take_over)
            state["batch_size"] = self.batch_size
        return state

    def resharded_state(self, states: list[dict], reshard) -> dict:
        """This worker's sampler state when a checkpoint continues at another layout
        (`localsgd.loop.checkpoint.state`): at the same world size each worker its own position;
        otherwise, or from a shared checkpoint, the old workers' epoch at the same fraction of
        this worker's new shard."""
        if not reshard.shared and reshard.old_world == reshard.world_size:
            return states[reshard.rank]
        old = states[reshard.source]
        old_n, new_n = int(old["num_indices"]), len(self.own)
        position = int(old["position"]) * new_n // max(old_n, 1)
        return {**old, "position": min(position, new_n), "num_indices": new_n}

    def load_state_dict(self, state: dict) -> None:
        n = int(state["num_indices"])
        if n != len(self.own):
            raise ValueError(
                f"sampler state is for a shard of {n} samples but this worker's shard "
                f"has {len(self.own)}; the data or dist settings changed since "
                f"the checkpoint"
            )
        self.extra = torch.as_tensor(state.get("extra", []), dtype=torch.int64)
        self.sources = [int(s) for s in state.get("sources", [])]
        self.indices = torch.cat([self.own, self.extra]) if self.sources else self.own
        self.batch_size = int(state.get("batch_size", self.own_batch_size))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perm = None

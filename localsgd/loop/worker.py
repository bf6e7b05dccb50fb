"""Who this worker is: its rank among all workers, on its machine, and its restart attempt."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity, as callbacks see it (`trainer.info.rank`, `trainer.info.world_size`).

    `attempt` counts restarts of the whole job by torchrun (`--max-restarts`): 0 on the first
    run, and always 0 for workers the CLI spawns itself.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int = 0

    @classmethod
    def from_torchrun(cls) -> WorkerInfo:
        """The identity torchrun gives in the environment (the one place it is read)."""
        world = int(os.environ["WORLD_SIZE"])
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=world,
            local_rank=int(os.environ["LOCAL_RANK"]),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )

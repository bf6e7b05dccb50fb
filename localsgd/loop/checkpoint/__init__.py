"""Checkpoints: writing them in one layout or another, finding a complete one, resuming from it
with any world size or shard size.

One concern a module:

- `folders`: where checkpoints live (`checkpoints/step-N/`), atomic files, the `COMPLETE`
  marker, `verify`, `newest_complete`, pruning, the workers' own files beside a shared one;
- `layout`: the one save skeleton (`save`: write, barrier, marker, publish) and the layouts it
  takes as a parameter: every rank its own (`PerRank`), one state for every worker (`Shared`,
  under ft=torchft), sharded through DCP (`Sharded`, `SharedSharded`);
- `state`: the registry's components (`Stateful`, `ModuleState`, `RNGState`) and how each moves
  its state to another layout (`resharded_state`, `Reshard`);
- `averager_state`: the averager as a component (`AveragerState`): its own part of a shared
  checkpoint, its anchors, outer momentum and residuals at another layout;
- `dcp`: the model and optimizer of sharded runs through torch.distributed.checkpoint;
- `relayout`: flat state cut to other shards, FSDP2's units;
- `reshard`: resuming (`resume`, `resume_line`): each rank its own, or every component moved;
- `same_run`: which settings a resume may change (`config_mismatch`).

Tree walks over state dicts (clone, sum, mean, local shards) are `localsgd.averaging.trees`.
"""

from localsgd.loop.checkpoint.averager_state import AveragerState
from localsgd.loop.checkpoint.folders import (
    CHECKPOINTS,
    MARKER,
    CheckpointError,
    checkpoint_root,
    has_marked,
    listed_steps,
    load_own,
    newest_complete,
    own_dir,
    prune,
    rank_file,
    read_marker,
    save_model,
    save_own,
    step_dir,
    verify,
    written_at,
    written_by,
)
from localsgd.loop.checkpoint.layout import (
    Layout,
    PerRank,
    Sharded,
    Shared,
    SharedSharded,
    layout_for,
    save,
    save_shared,
)
from localsgd.loop.checkpoint.reshard import resume, resume_line
from localsgd.loop.checkpoint.same_run import ADDED_KEYS, RESUME_MAY_CHANGE, config_mismatch
from localsgd.loop.checkpoint.state import (
    ModuleState,
    Reshard,
    RNGState,
    Stateful,
    restore,
    rng_state,
    set_rng_state,
)

__all__ = [
    "ADDED_KEYS",
    "CHECKPOINTS",
    "MARKER",
    "RESUME_MAY_CHANGE",
    "AveragerState",
    "CheckpointError",
    "Layout",
    "ModuleState",
    "PerRank",
    "RNGState",
    "Reshard",
    "Shared",
    "Sharded",
    "SharedSharded",
    "Stateful",
    "checkpoint_root",
    "config_mismatch",
    "has_marked",
    "layout_for",
    "listed_steps",
    "load_own",
    "newest_complete",
    "own_dir",
    "prune",
    "rank_file",
    "read_marker",
    "restore",
    "resume",
    "resume_line",
    "rng_state",
    "save",
    "save_model",
    "save_own",
    "save_shared",
    "set_rng_state",
    "step_dir",
    "verify",
    "written_at",
    "written_by",
]

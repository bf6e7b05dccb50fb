"""Where checkpoints live and when one is complete: folders, atomic files, the marker, verify.

`RUN_DIR/checkpoints/step-N/` holds one checkpoint: rank files (`rank-R.pt`), DCP's files for
sharded runs (`dcp/`), and `COMPLETE`, a small JSON marker written last (`layout.save`), once
every file is in place. Each file is written to a temporary name, fsynced and renamed, so a
process killed mid-write leaves either nothing or a whole file under the real name, and a folder
without its marker is never used. `checkpoints/own/step-N/rank-R.pt` holds what is each worker's
own beside a shared checkpoint (its error-feedback residuals).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
PREFIX = "step-"
# A shared checkpoint is one worker's state; what is each worker's own (error-feedback
# residuals: what that worker failed to send) goes beside it, one file per worker
OWN = "own"


class CheckpointError(ValueError):
    """A checkpoint is missing, partial or corrupt; the message is one line naming it."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), f"{PREFIX}{step}")


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.pt")


def own_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), OWN, f"{PREFIX}{step}")


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable) -> None:
    """`write(f)` into a temporary file beside `path`, fsynced, then renamed to `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def save_state(path: str, state: dict) -> None:
    """A rank state, `torch.save`d atomically."""
    write_atomic(path, lambda f: torch.save(state, f))


def write_marker(folder: str, marker: dict) -> None:
    write_atomic(os.path.join(folder, MARKER), lambda f: f.write(json.dumps(marker).encode()))


def read_marker(folder: str) -> dict | None:
    """A folder's marker, or None when it has no valid one (partial)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def file_sizes(folder: str, ranks: int) -> dict[str, int]:
    """The sizes of rank files 0..ranks-1 in `folder`, by name (a marker's `files`)."""
    return {
        os.path.basename(rank_file(folder, r)): os.path.getsize(rank_file(folder, r))
        for r in range(ranks)
    }


def listed_steps(run_dir: str) -> list[int]:
    """Steps of every `step-N` folder, complete or not, newest first."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit():
            steps.append(int(name[len(PREFIX) :]))
    return sorted(steps, reverse=True)


def prune(run_dir: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and older partial ones."""
    complete = [s for s in listed_steps(run_dir) if read_marker(step_dir(run_dir, s)) is not None]
    if not complete:
        return
    kept = set(complete[:keep])
    oldest_kept = min(kept)
    for s in listed_steps(run_dir):
        if s not in kept and s < oldest_kept:
            shutil.rmtree(step_dir(run_dir, s), ignore_errors=True)
    own = os.path.join(checkpoint_root(run_dir), OWN)
    for name in os.listdir(own) if os.path.isdir(own) else ():
        step = name[len(PREFIX) :]
        if step.isdigit() and int(step) < oldest_kept:
            shutil.rmtree(os.path.join(own, name), ignore_errors=True)


def save_own(run_dir: str, step: int, rank: int, state: dict) -> None:
    """This worker's own part of the shared checkpoint at `step` (no collective; atomic)."""
    folder = own_dir(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    save_state(rank_file(folder, rank), state)


def load_own(folder: str, device: torch.device | str = "cpu") -> dict[int, dict]:
    """The workers' own parts saved beside the shared checkpoint `folder`, by rank ({} when
    none: a checkpoint without them, or one whose workers had nothing of their own)."""
    marker = read_marker(folder) or {}
    own = own_dir(os.path.dirname(os.path.dirname(folder)), int(marker.get("step", -1)))
    if not os.path.isdir(own):
        return {}
    out = {}
    for name in os.listdir(own):
        if name.startswith("rank-") and name.endswith(".pt") and name[5:-3].isdigit():
            path = os.path.join(own, name)
            out[int(name[5:-3])] = torch.load(path, map_location=device, weights_only=True)
    return out


def verify(folder: str, world_size: int | None = None) -> dict:
    """Check a checkpoint folder is complete and loadable; return its marker or raise
    CheckpointError with one line saying what is wrong. Any world size continues a complete
    checkpoint (`localsgd.loop.checkpoint.reshard`); `world_size` is kept for the callers that
    pass it."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} does not exist")
    marker = read_marker(folder)
    if marker is None:
        raise CheckpointError(f"{folder} is partial: no valid {MARKER} marker")
    at_sync = False
    for name, size in marker["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise CheckpointError(f"{path} is missing or truncated")
        try:  # mmap: checks the archive without reading every tensor into memory
            state = torch.load(path, weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"{path} is corrupt ({type(e).__name__})") from None
        if not isinstance(state, dict) or state.get("step") != marker["step"]:
            raise CheckpointError(f"{path} is corrupt (not a localsgd rank state)")
        if name == os.path.basename(rank_file(folder, 0)):
            loop = state.get("loop")
            at_sync = isinstance(loop, dict) and loop.get("in_sync") is True
    for name, size in marker.get("dcp_files", {}).items():  # a sharded run's (checkpoint.dcp)
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise CheckpointError(f"{path} is missing or truncated")
    if marker.get("shared") and not at_sync:
        raise CheckpointError(f"{folder} is corrupt (a shared state taken between syncs)")
    return marker


def has_marked(run_dir: str) -> bool:
    """Whether some checkpoint folder carries a marker (was complete once)."""
    return any(read_marker(step_dir(run_dir, s)) is not None for s in listed_steps(run_dir))


def newest_complete(run_dir: str, world_size: int | None, warn=None) -> str | None:
    """The newest checkpoint in `run_dir` that verifies; a broken one is reported through `warn`
    and skipped, so a kill during a write falls back to the previous checkpoint."""
    for s in listed_steps(run_dir):
        folder = step_dir(run_dir, s)
        try:
            verify(folder, world_size)
            return folder
        except CheckpointError as e:
            if warn is not None:
                warn(f"skipping checkpoint: {e}")
    return None


def written_by(folder: str) -> int:
    """The world size that wrote a (verified) checkpoint folder."""
    return int(read_marker(folder)["world_size"])


def written_at(folder: str) -> int:
    """The step a (verified) checkpoint folder was written after."""
    return int(read_marker(folder)["step"])


def rank_states(folder: str) -> int:
    """How many rank states a (verified) checkpoint folder holds: one per worker, one for all
    (a shared checkpoint), or one per rank of the writing replica group (shared, sharded)."""
    return len(read_marker(folder)["files"])


def save_model(
    model: torch.nn.Module, run_dir: str, state: dict[str, torch.Tensor] | None = None
) -> None:
    """The final model as `model.pt`, written atomically: `model`'s state_dict, or `state`
    (a sharded model's, gathered whole: `Sharding.full_state`)."""
    state = model.state_dict() if state is None else state
    # Cloned, so the file holds each tensor alone rather than views of the shared flat buffer.
    state = {k: v.detach().clone().cpu() for k, v in state.items()}
    path = os.path.join(run_dir, "model.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)

"""Checkpoints: one state file per rank in `checkpoints/step-N/`, complete once rank 0 marks it.

Layout: `RUN_DIR/checkpoints/step-N/rank-R.pt` (every rank's own state: replicas differ between
syncs) and `COMPLETE`, a small JSON file rank 0 writes after a barrier, i.e. once every rank's file
is on disk. Each file is written to a temporary name, fsynced and renamed, so a process killed
mid-write leaves either nothing or a whole file under the real name, and a checkpoint without its
marker is never used. Only checkpoint steps run the barrier; the local phase stays collective-free.

A *shared* checkpoint (`save_shared`, written under `ft=torchft`) holds one state, `rank-0.pt`,
written by one worker right after a global average, when every worker holds the same model: the
job continues from it at any world size, as from a checkpoint taken at a sync
(`localsgd.loop.reshard`). Its folder is written under a temporary name and renamed into place, so
that when several workers race to write the same step, one folder wins whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint is missing, partial or corrupt; the message is one line naming it."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), f"{_PREFIX}{step}")


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.pt")


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def listed_steps(run_dir: str) -> list[int]:
    """Steps of every `step-N` folder, complete or not, newest first."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
            steps.append(int(name[len(_PREFIX) :]))
    return sorted(steps, reverse=True)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


class ModuleState:
    """A module's state, cloned on save: its tensors are views of the averager's flat buffers,
    and `torch.save` of a view writes the whole buffer."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)  # copies into the flat buffers' views


class RNGState:
    """The process's random generators (torch, CUDA, NumPy, Python) as one stateful object."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


def save(
    run_dir: str,
    step: int,
    rank: int,
    world_size: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
) -> str:
    """Every rank calls this at the same step with its own components' states; returns the
    folder. `config` (the run's resolved config) goes into the marker, to refuse resuming a
    changed run."""
    state = {"step": step, **{name: c.state_dict() for name, c in components.items()}}
    folder = step_dir(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    _write_atomic(rank_file(folder, rank), lambda f: torch.save(state, f))
    dist.barrier()  # every rank's file is renamed into place before the marker exists
    if rank == 0:
        sizes = {
            os.path.basename(rank_file(folder, r)): os.path.getsize(rank_file(folder, r))
            for r in range(world_size)
        }
        marker = {"step": step, "world_size": world_size, "files": sizes, "config": config}
        _write_atomic(os.path.join(folder, MARKER), lambda f: f.write(json.dumps(marker).encode()))
        prune(run_dir, keep)
    return folder


def save_shared(
    run_dir: str,
    step: int,
    world_size: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
) -> str:
    """One worker's state, taken when every worker holds the same (averaged) model, as the
    whole checkpoint of a job of `world_size` workers; no collective. Returns the folder; if
    another worker wrote this step first, that folder is kept and this state dropped."""
    state = {"step": step, **{name: c.state_dict() for name, c in components.items()}}
    folder = step_dir(run_dir, step)
    root = checkpoint_root(run_dir)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".{_PREFIX}{step}.tmp{os.getpid()}")  # not a listed step
    os.makedirs(tmp, exist_ok=True)
    _write_atomic(rank_file(tmp, 0), lambda f: torch.save(state, f))
    name = os.path.basename(rank_file(tmp, 0))
    marker = {
        "step": step,
        "world_size": world_size,
        "files": {name: os.path.getsize(rank_file(tmp, 0))},
        "shared": True,
        "config": config,
    }
    return publish(tmp, folder, marker, run_dir, keep)


def publish(tmp: str, folder: str, marker: dict, run_dir: str, keep: int) -> str:
    """Mark the complete shared checkpoint written in `tmp` and rename it to `folder`,
    atomically: a rename fails if the folder exists, so of several writers (workers, or replica
    groups after a lost quorum) one wins whole. Returns `folder`."""
    _write_atomic(os.path.join(tmp, MARKER), lambda f: f.write(json.dumps(marker).encode()))
    if os.path.isdir(folder) and _marker(folder) is None:
        shutil.rmtree(folder, ignore_errors=True)  # a partial folder of an earlier life
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return folder
    _fsync_dir(checkpoint_root(run_dir))
    prune(run_dir, keep)
    return folder


# A shared checkpoint is one worker's state; what is each worker's own in it (error-feedback
# residuals: what that worker failed to send) goes beside it, one file per worker, so that a
# resume gives each its own (`localsgd.loop.reshard`), never the writer's to all.
OWN = "own"


def own_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), OWN, f"{_PREFIX}{step}")


def save_own(run_dir: str, step: int, rank: int, state: dict) -> None:
    """This worker's own part of the shared checkpoint at `step` (no collective; atomic)."""
    folder = own_dir(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    _write_atomic(rank_file(folder, rank), lambda f: torch.save(state, f))


def load_own(folder: str, device: torch.device | str = "cpu") -> dict[int, dict]:
    """The workers' own parts saved beside the shared checkpoint `folder`, by rank ({} when
    none: a checkpoint without them, or one whose workers had nothing of their own)."""
    marker = _marker(folder) or {}
    own = own_dir(os.path.dirname(os.path.dirname(folder)), int(marker.get("step", -1)))
    if not os.path.isdir(own):
        return {}
    out = {}
    for name in os.listdir(own):
        if name.startswith("rank-") and name.endswith(".pt") and name[5:-3].isdigit():
            path = os.path.join(own, name)
            out[int(name[5:-3])] = torch.load(path, map_location=device, weights_only=True)
    return out


def prune(run_dir: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and older partial ones."""
    complete = [s for s in listed_steps(run_dir) if _marker(step_dir(run_dir, s)) is not None]
    if not complete:
        return
    kept = set(complete[:keep])
    oldest_kept = min(kept)
    for s in listed_steps(run_dir):
        if s not in kept and s < oldest_kept:
            shutil.rmtree(step_dir(run_dir, s), ignore_errors=True)
    own = os.path.join(checkpoint_root(run_dir), OWN)
    for name in os.listdir(own) if os.path.isdir(own) else ():
        step = name[len(_PREFIX) :]
        if step.isdigit() and int(step) < oldest_kept:
            shutil.rmtree(os.path.join(own, name), ignore_errors=True)


def _marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verify(folder: str, world_size: int | None = None) -> dict:
    """Check a checkpoint folder is complete and loadable; return its marker or raise
    CheckpointError with one line saying what is wrong. Any world size continues a complete
    checkpoint (`localsgd.loop.reshard`); `world_size` is kept for the callers that pass it."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} does not exist")
    marker = _marker(folder)
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
    for name, size in marker.get("dcp_files", {}).items():  # a sharded run's (checkpoint_dcp)
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise CheckpointError(f"{path} is missing or truncated")
    if marker.get("shared") and not at_sync:
        raise CheckpointError(f"{folder} is corrupt (a shared state taken between syncs)")
    return marker


# The settings a resume may change: they do not touch the trajectory (a run extended, how it is
# logged, checkpointed, timed out or shown, a simulated network). Every other setting shapes the
# trajectory, so a resume with it changed is refused: new settings are safe by default.
RESUME_MAY_CHANGE = (
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.eval_every",
    "trainer.eval_batch_size",
    "trainer.eval_samples",
    "trainer.sample_chars",
    "trainer.callbacks",  # observers by contract; one that changes the run is the user's call
    "trainer.log_every",
    "trainer.progress",
    "trainer.track_drift",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.resume",
    "trainer.keep_best",  # which weights are also kept, not how the run trains
    "dist.timeout_s",
    "dist.world_size",  # from a checkpoint taken at a sync (localsgd.loop.reshard)
    "data.num_workers",  # batches are seeded per batch: the same for any number of loaders
    "data.loader",  # memory or stream: the same batches
    "sync.check_replicas",
    "sync.outer_state",  # where the outer state lives: the same bits (tests/test_outer_state.py)
    "comm.simulate",
    "logger",
    "optimized_metric",  # what a sweep reads of the summary, not how the run trains
    "ft",  # with no fault, averaging through torchft is bit-identical (tests/test_ft_cli.py)
)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_MAY_CHANGE)


# keys added after checkpoints were first written: the value a checkpoint without the key ran
# with, so that a run interrupted before the key existed still resumes
ADDED_KEYS = {"dist.shard_size": 1, "data.val_fraction": 0.0}  # no validation split before


def config_mismatch(marker: dict, config: dict) -> str | None:
    """The first setting outside `RESUME_MAY_CHANGE` that differs between a checkpoint and
    `config` (plain dicts), as "key: checkpoint value, this run's value", or None."""
    saved = marker.get("config")
    if saved is None:
        return None
    old_flat, new_flat = _flatten(saved), _flatten(config)
    for k in sorted(set(old_flat) | set(new_flat)):
        old = old_flat.get(k, ADDED_KEYS.get(k))
        if not _may_change(k) and old != new_flat.get(k):
            return f"{k}: {old!r} in the checkpoint, {new_flat.get(k)!r} now"
    return None


def has_marked(run_dir: str) -> bool:
    """Whether some checkpoint folder carries a marker (was complete once)."""
    return any(_marker(step_dir(run_dir, s)) is not None for s in listed_steps(run_dir))


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


def load(
    folder: str,
    rank: int,
    device: torch.device,
    components: Mapping[str, Stateful],
    optional: tuple[str, ...] = (),
) -> int:
    """Restore every component from this rank's file in `folder`; returns the step. Those named
    in `optional` may be absent from the file (e.g. drift, when tracking was off)."""
    state = torch.load(rank_file(folder, rank), map_location=device, weights_only=True)
    restore(state, components, optional, folder)
    return int(state["step"])


def restore(
    state: dict, components: Mapping[str, Stateful], optional: tuple[str, ...], folder: str
) -> None:
    """Load each component from its entry of `state`, a rank state read from `folder`."""
    for name, component in components.items():
        if name in state:
            component.load_state_dict(state[name])
        elif name not in optional:
            raise ValueError(f"checkpoint {folder} holds no {name!r} state")


# RNG states: the torch generators always; Python's and NumPy's as plain lists and tensors, so the
# file stays loadable with weights_only=True.
def rng_state() -> dict:
    import random

    import numpy as np

    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
    }


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))

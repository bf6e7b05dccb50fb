"""Writing a checkpoint: one skeleton (`save`: write, barrier, marker, publish), and the layout
as a parameter.

Every checkpoint is written the same way: each writer puts its files into the folder (`write`),
the writers meet (`barrier`: every file is in place), one of them writes the `COMPLETE` marker
with the files' sizes (`marker`), and the checkpoint is published (`publish`): a folder written
in place is complete once marked; one written under a temporary name is renamed into place,
atomically, so that of several writers racing for one step (workers, or replica groups after a
lost quorum) one wins whole. Then older checkpoints are pruned. The layouts:

- `PerRank`: every rank its own state, `rank-R.pt` (replicas differ between syncs), in place;
  rank 0 marks it after a barrier. Unsharded runs.
- `Shared`: one state for every worker, written by one worker right after a global average,
  when every worker holds the same model (under ft=torchft), with no collective; it continues
  at any world size (`localsgd.loop.checkpoint.reshard`).
- `Sharded`: sharded runs (`dist.shard_size` > 1): the model and optimizer through DCP
  (`localsgd.loop.checkpoint.dcp`), the rest per rank, in place; rank 0 marks it.
- `SharedSharded`: a shared checkpoint of sharded replica groups (ft=torchft): the replica group
  that led the round writes it, its ranks together, in `Sharded`'s layout of one group.

A shared checkpoint is one worker's state: what is each worker's own in it (error-feedback
residuals, a component's `own_state()`) goes beside it, written by every worker, the writer's
included (`checkpoints/own/step-N/rank-R.pt`), so that a resume gives each its own.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

import torch.distributed as dist

from localsgd.loop.checkpoint import dcp
from localsgd.loop.checkpoint.folders import (
    MARKER,
    PREFIX,
    checkpoint_root,
    file_sizes,
    fsync_dir,
    prune,
    rank_file,
    read_marker,
    save_own,
    save_state,
    step_dir,
    write_marker,
)
from localsgd.loop.checkpoint.state import Stateful


def save(
    layout: Layout,
    run_dir: str,
    step: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
    writes: bool = True,
) -> str:
    """Write the checkpoint of `step` in `layout`: this process's part of it. `config` (the
    run's resolved config) goes into the marker, to refuse resuming a changed run; `keep`: how
    many complete checkpoints are kept. `writes` False: this worker saves only what is its own
    (a shared layout whose writer is another). Returns the folder ("" when not `writes`)."""
    layout.write_own(run_dir, step, components)
    if not writes:
        return ""
    final = step_dir(run_dir, step)
    folder = layout.folder(run_dir, step)
    layout.write(folder, step, components)
    layout.barrier()  # every writer's files are in place before the marker exists
    if not layout.marks():
        return final
    write_marker(folder, layout.marker(folder, step, components, config))
    return layout.publish(folder, final, run_dir, keep)


class Layout:
    """How one checkpoint is laid out and who writes what (the module docstring); `save` calls
    these in its one order. `rank` and `world_size`: this worker's, in the whole job."""

    shared = False  # one state for every worker (written by one), or every rank its own

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def write_own(self, run_dir: str, step: int, components: Mapping[str, Stateful]) -> None:
        """What is this worker's own beside a shared checkpoint (nothing for the others)."""
        if not self.shared:
            return
        own: dict = {}
        for component in components.values():
            part = component.own_state() if hasattr(component, "own_state") else None
            own.update(part or {})
        if own:
            save_own(run_dir, step, self.rank, own)

    def folder(self, run_dir: str, step: int) -> str:
        """Where this checkpoint is written: its folder, made if missing (written in place)."""
        folder = step_dir(run_dir, step)
        os.makedirs(folder, exist_ok=True)
        return folder

    def write(self, folder: str, step: int, components: Mapping[str, Stateful]) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        dist.barrier()

    def marks(self) -> bool:
        """Whether this process writes the marker and publishes (one process a checkpoint)."""
        return self.rank == 0

    def marker(
        self, folder: str, step: int, components: Mapping[str, Stateful], config: dict | None
    ) -> dict:
        raise NotImplementedError

    def publish(self, folder: str, final: str, run_dir: str, keep: int) -> str:
        """Make the marked checkpoint in `folder` the one of its step, `final`: a folder
        written elsewhere is renamed into place (a rename fails if the folder exists, so of
        several writers one wins whole; a partial folder of an earlier life is replaced). Then
        prune older checkpoints. Returns `final`."""
        if folder != final:
            if os.path.isdir(final) and read_marker(final) is None:
                shutil.rmtree(final, ignore_errors=True)  # a partial folder of an earlier life
            try:
                os.rename(folder, final)
            except OSError:
                shutil.rmtree(folder, ignore_errors=True)
                return final  # another writer's folder won
            fsync_dir(checkpoint_root(run_dir))
        prune(run_dir, keep)
        return final


def _state(step: int, components: Mapping[str, Stateful]) -> dict:
    return {"step": step, **{name: c.state_dict() for name, c in components.items()}}


class PerRank(Layout):
    """Every rank its own state in `rank-R.pt`; rank 0 marks the folder after a barrier."""

    def write(self, folder, step, components) -> None:
        save_state(rank_file(folder, self.rank), _state(step, components))

    def marker(self, folder, step, components, config) -> dict:
        files = file_sizes(folder, self.world_size)
        return {"step": step, "world_size": self.world_size, "files": files, "config": config}


class Shared(Layout):
    """One worker's state (`rank-0.pt`) as the whole checkpoint of the job's `world_size`
    workers, written by one worker with no collective, under a temporary name."""

    shared = True

    def folder(self, run_dir: str, step: int) -> str:
        root = checkpoint_root(run_dir)
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, f".{PREFIX}{step}.tmp{os.getpid()}")  # not a listed step
        os.makedirs(tmp, exist_ok=True)
        return tmp

    def write(self, folder, step, components) -> None:
        save_state(rank_file(folder, 0), _state(step, components))

    def barrier(self) -> None:
        pass  # one writer

    def marks(self) -> bool:
        return True

    def marker(self, folder, step, components, config) -> dict:
        return {
            "step": step,
            "world_size": self.world_size,
            "files": file_sizes(folder, 1),
            "shared": True,
            "config": config,
        }


class Sharded(Layout):
    """The model and optimizer of every replica group (of `shard_size` ranks) through DCP, the
    rest per rank; rank 0 marks the folder after a barrier (`localsgd.loop.checkpoint.dcp`)."""

    def __init__(self, rank: int, world_size: int, shard_size: int):
        super().__init__(rank, world_size)
        self.shard_size = shard_size

    def write(self, folder, step, components) -> None:
        if self.rank == 0 and os.path.exists(os.path.join(folder, MARKER)):
            # an earlier life's marker over the files rewritten now: gone before any is (the
            # ranks meet in DCP's first collective), so a kill mid-save leaves an unmarked folder
            os.remove(os.path.join(folder, MARKER))
        dcp.write_states(folder, step, self.rank, components, self.rank // self.shard_size)

    def marker(self, folder, step, components, config) -> dict:
        size, world = self.shard_size, self.world_size
        return dcp.marker_of(folder, step, world, size, world, components, config)


class SharedSharded(Sharded):
    """The one state every replica group holds, written by the group that led the round: its
    `shard_size` ranks together (a broadcast, DCP's collectives and a barrier over the group's
    process group, the default one under torchrun), in `Sharded`'s layout of one group, under a
    temporary name; `rank` is the global one (of the own files), the rank in the group is the
    process group's."""

    shared = True

    def folder(self, run_dir: str, step: int) -> str:
        root = checkpoint_root(run_dir)
        os.makedirs(root, exist_ok=True)
        # one temporary folder for the group (not a listed step), named by its rank 0: the
        # group's index keeps groups on other machines (whose pids may be the same) apart
        group = self.rank // self.shard_size
        name = [f".{PREFIX}{step}.group{group}.tmp{os.getpid()}"]
        dist.broadcast_object_list(name, src=0)
        tmp = os.path.join(root, name[0])
        os.makedirs(tmp, exist_ok=True)
        return tmp

    def write(self, folder, step, components) -> None:
        dcp.write_states(folder, step, dist.get_rank(), components, 0)

    def marks(self) -> bool:
        return dist.get_rank() == 0  # the group's rank 0

    def marker(self, folder, step, components, config) -> dict:
        size = self.shard_size
        marker = dcp.marker_of(folder, step, self.world_size, size, size, components, config)
        marker.update(shared=True, group=self.rank // size)
        return marker


def layout_for(shared: bool, shard_size: int, rank: int, world_size: int) -> Layout:
    """The layout of a run's checkpoints, decided once: shared (the round driver's word: under
    ft=torchft) or every rank its own; sharded (DCP) when `shard_size` > 1."""
    if shard_size > 1:
        cls = SharedSharded if shared else Sharded
        return cls(rank, world_size, shard_size)
    return (Shared if shared else PerRank)(rank, world_size)


def save_shared(
    run_dir: str,
    step: int,
    world_size: int,
    components: Mapping[str, Stateful],
    keep: int,
    config: dict | None = None,
) -> str:
    """`save` in the `Shared` layout: one worker's state, taken when every worker holds the same
    (averaged) model, as the whole checkpoint of a job of `world_size` workers. Returns the
    folder; if another worker wrote this step first, that folder is kept and this state
    dropped."""
    return save(Shared(0, world_size), run_dir, step, components, keep, config)

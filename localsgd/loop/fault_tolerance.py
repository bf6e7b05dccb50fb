"""The trainer's side of `ft=torchft`: its averages as torchft rounds, and healing a restarted
worker from a live peer.

The averaging core's `FaultTolerantAverager` runs each widest-level average (and each warmup
gradient average) as a round: a quorum of the live replica groups, the average over them,
`should_commit()`, and a rollback to the last committed weights when the round failed. What a
healing worker receives is registered here: the averager with its outer state and flat
buffers (sent by the core), the model's other buffers, the optimizer, the GradScaler, the
communication counters and the loop's own state (step, pending loss, next evaluation). Its
sampler takes the peer's position in the data, which every worker shares at a given step, on
its own shard. Its RNG is its own, reseeded for the new attempt, so that no two workers draw
the same dropout masks.

Checkpoints on disk are *shared* (`checkpoint.save_shared`): right after a committed round every
worker holds the same model, so one worker's state is the job's. The first committed round at or
after each multiple of `trainer.checkpoint_every` (and the final average) is written by the
replica group that ranked first in its quorum (its rank 0), with no collective. A round that
finds no quorum (fewer than `ft.min_replicas` groups for `ft.quorum_timeout_s`) is rolled back to
the last global state; every surviving group's rank 0 then races to write that state as the
stop checkpoint (one folder wins whole) and the worker raises `QuorumLost` naming it. The job
continues from either at any world size, with or without ft (`localsgd.loop.reshard`).
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from localsgd.averaging.fault_tolerant import (
    FaultTolerantAverager,
    QuorumLost,
    TorchftCommunicator,
    make_manager,
)

if TYPE_CHECKING:
    from localsgd.loop.trainer import Trainer


class NoLivePeer(RuntimeError):
    """A restarted worker found no live peer to heal from (the others finished, or died)."""


def replica_name(rank: int) -> str:
    """torchft orders quorum members by id and reads trailing digits as ranks: zero-padded,
    the replicas sum in the same order as ranks do on the torch.distributed path."""
    return f"replica_{rank:03d}"


def build_fault_tolerance(trainer: Trainer) -> FaultTolerantAverager:
    """The trainer's synchroniser, averaging through a torchft Manager of its own."""
    ft, info, sync = trainer.cfg.ft, trainer.info, trainer.sync
    group: dict[str, Any] = {}
    if ft.replica_groups is not None:  # torchrun: this machine's ranks are the replica group
        group = {**_group_store(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    manager = make_manager(
        replica_id=ft.replica_id or replica_name(info.rank),
        lighthouse=ft.lighthouse,
        min_replicas=ft.min_replicas,
        host=ft.host,
        timeout_s=ft.timeout_s,
        quorum_timeout_s=ft.quorum_timeout_s,
        connect_timeout_s=min(ft.timeout_s, 10.0),
        **group,
    )
    comm = TorchftCommunicator(
        manager, stats=sync.stats, link=sync.averager.comm.link, replicas=replica_groups(trainer)
    )
    guard = FaultTolerantAverager(
        sync.averager, comm, gradients=sync.grad_averager, check_replicas=sync.verify
    )
    loop = trainer
    guard.register_state("model", _buffers_of(trainer.model), _load_buffers(trainer.model))
    guard.register_state(
        "optimizer", trainer.optimizer.state_dict, trainer.optimizer.load_state_dict
    )
    guard.register_state("scaler", trainer.recipe.state_dict, trainer.recipe.load_state_dict)
    guard.register_state("comm", sync.stats.state_dict, sync.stats.load_state_dict)
    guard.register_state("loop", lambda: {**loop.state_dict(), "step": loop.step}, _load_loop(loop))
    guard.register_state("sampler", trainer.batches.state_dict, _load_position(trainer))
    return guard


def _group_store() -> dict[str, Any]:
    """A store for the Manager of this machine's ranks, new with every torchrun attempt: in
    torchrun's own store a restarted group would read the dead attempt's manager address.
    Hosted by rank 0 of the group on 127.0.0.1 (the group is one machine)."""
    store, box = None, [None]
    if dist.get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        box = [store.port]
    dist.broadcast_object_list(box, src=0)
    _STORES.append(store)  # kept alive for the process's life
    return {"store_addr": "127.0.0.1", "store_port": box[0]}


_STORES: list[Any] = []


def _buffers_of(model: torch.nn.Module):
    # the parameters travel as the averager's flat buffers; what else the model holds
    # (BatchNorm statistics) travels here
    return lambda: dict(model.named_buffers())


def _load_buffers(model: torch.nn.Module):
    def load(state: dict[str, torch.Tensor]) -> None:
        mine = dict(model.named_buffers())
        with torch.no_grad():
            for name, value in state.items():
                mine[name].copy_(value)

    return load


def _load_loop(trainer: Trainer):
    def load(state: dict[str, Any]) -> None:
        trainer.load_state_dict({k: v for k, v in state.items() if k != "step"})
        trainer.step = int(state["step"])

    return load


def _load_position(trainer: Trainer):
    def load(state: dict[str, Any]) -> None:
        # the peer's epoch and position, on this worker's own shard
        own = trainer.batches.state_dict()
        trainer.batches.load_state_dict({**state, "num_indices": own["num_indices"]})

    return load


def replica_groups(trainer: Trainer) -> int:
    """How many replica groups the job has: one per machine under torchrun, else one per
    worker."""
    return trainer.cfg.ft.replica_groups or trainer.info.world_size


def join(trainer: Trainer) -> str:
    """Before the first step: the first round. A fresh worker waits until all W have joined;
    a restarted one heals from a live peer inside the round that peer is in, finishes it, and
    continues from where the peer will be after it. Returns the round's phase; raises
    `NoLivePeer` for a restarted worker that found no peer ahead of it, which must not train."""
    guard, info, ft = trainer.sync.ft, trainer.info, trainer.cfg.ft
    with warnings.catch_warnings():
        # torch's checkpoint reader warns that the received bytes are read-only; they are
        # copied into this worker's own tensors at once
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        phase = guard.start(
            wait_for=replica_groups(trainer) if info.attempt == 0 else 1,
            timeout_s=ft.quorum_timeout_s,
        )
    if phase == "fresh" and info.attempt > 0:
        # restarted, and no peer was ahead of it: the others finished (or all died); training
        # alone from step 0 would add nothing to the job
        raise NoLivePeer(
            f"worker {info.rank} restarted but found no live peer to heal from; it stops"
        )
    if phase == "fresh":
        return phase
    torch.manual_seed(trainer.cfg.seed + 1000 * info.rank + 1 + 7919 * info.attempt)
    sync = trainer.sync
    if phase == "grad":  # the peer is inside the warmup step's gradient average
        trainer.recipe.step(trainer.optimizer)
        sync.synchronous = True
        sync.after_step(None)
        trainer.step += 1
    elif phase == "sync":  # inside the peer's after_step: the average of step `trainer.step`
        sync.in_sync = sync.averager.all_in_sync
        trainer.step += 1
    else:  # "average": the final average, after the last step
        sync.in_sync = True
    print(
        f"ft: worker {info.rank} healed from a live peer; it trains on from step {trainer.step}",
        file=sys.stderr,
        flush=True,
    )
    return phase


def after_round(trainer: Trainer, final: bool = False) -> None:
    """After a step (or the final average): a shared checkpoint when one is due and a round just
    committed; after a round that found no quorum, the stop checkpoint, then `QuorumLost`."""
    guard, every = trainer.sync.ft, trainer.cfg.trainer.checkpoint_every
    committed, guard.just_committed = guard.just_committed, False
    final = final or trainer.step >= trainer.cfg.trainer.max_steps
    writes = dist.get_rank() == 0  # one process per replica group
    if guard.quorum_lost is not None:
        why, guard.quorum_lost = guard.quorum_lost, None
        ft = trainer.cfg.ft
        below = (
            f"fewer than ft.min_replicas={ft.min_replicas} replica groups for "
            f"ft.quorum_timeout_s={ft.quorum_timeout_s:g} at step {trainer.step} ({why})"
        )
        if guard.undo:  # a fragment's sync undone: the workers hold their own values
            raise QuorumLost(
                f"{below}; stopped without a checkpoint of this state (Streaming DiLoCo's "
                "workers are not in sync between rounds)"
            )
        trainer.in_sync = True  # rolled back: every worker holds the last global state
        folder = trainer.save_checkpoint(shared=True) if writes else "its newest checkpoint"
        raise QuorumLost(
            f"{below}; stopped with the last global state in {folder}: run the same command to "
            f"resume, at any dist.world_size"
        )
    if every <= 0 or not committed or not trainer.in_sync:
        return
    mark = trainer.step // every
    if mark <= guard.checkpoint_mark and not final:
        return
    guard.checkpoint_mark = mark
    if guard.leads and writes:
        trainer.save_checkpoint(shared=True)

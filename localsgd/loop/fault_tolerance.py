"""The loop's side of `ft=torchft`, owned by the `Synchroniser`: the round driver built, the
first round (joining, or healing a restarted worker from a live peer), and the checkpoints and
stops that follow committed rounds.

The averaging core's `FaultTolerantRounds` runs each sync across replica groups (and each warmup
gradient average) as a round: a quorum of the live replica groups, the average over them,
`should_commit()`, and the state put back when the round failed. What a healing worker receives
is derived from the trainer's one registry of checkpointed state (`Trainer.stateful`), as
torchtitan derives its heal state from its checkpointer's: every entry but those in `NOT_HEALED`.
The averager and its flat buffers travel with the round driver's own state, less this worker's
error-feedback residuals. The sampler takes the peer's position in the data, which every worker
shares at a given step, on its own shard. The RNG is the worker's own, reseeded for the new
attempt, so that no two workers draw the same dropout masks.

Checkpoints on disk are *shared* (`shared_checkpoints`: `localsgd.loop.checkpoint.layout`'s
`Shared`): right after a committed round every worker holds the same model, so one worker's
state is the job's. The first committed round at or after each multiple of
`trainer.checkpoint_every` (and the final average) is written by the replica group that ranked
first in its quorum (its rank 0), with no collective; a sharded group (`dist.shard_size` > 1)
writes it with all its ranks together, through DCP (`SharedSharded`), having agreed within the
group that it leads; with error feedback every worker also writes its own residual beside it
(`checkpoints/own/`), so that a resume gives each its own. A stop (SIGTERM or Ctrl-C reaching
any worker) is carried by the next round to every replica group, which all stop after it, with a
shared checkpoint. A round that finds no quorum (fewer than `ft.min_replicas` groups for
`ft.quorum_timeout_s`) is put back to the last global state; every surviving group's rank 0 then
races to write that state as the stop checkpoint (one folder wins whole) and the worker raises
`QuorumLost` naming it. The job continues from either at any world size, with or without ft
(`localsgd.loop.checkpoint.reshard`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from localsgd.averaging.flat import is_dtensor
from localsgd.averaging.stores import serving_store
from localsgd.averaging.torchft import (
    FaultTolerantRounds,
    QuorumLost,
    TorchftCommunicator,
    make_manager,
)
from localsgd.averaging.trees import as_dtensor_like, into_dtensors, local_tree
from localsgd.config import FtConfig
from localsgd.loop.drift import RoundDriftMeter
from localsgd.loop.ft_clocks import RoundClock, gate_notice, grace_window, heartbeat_gate
from localsgd.loop.metrics import notice
from localsgd.loop.stop import signalled
from localsgd.loop.worker import WorkerInfo

# Registry entries a healing worker does not take from its peer: the averager (sent by the round
# driver itself, less this worker's residuals), its own random generators, the drift meter (only
# the worker that logs empties it at each log line: a peer's holds every figure since its start;
# a healed worker measures from its heal on) and the round driver's counters (sent with its
# state).
# the pacer is the worker's own too: its speed and its step counts (sync.inner_time_s)
NOT_HEALED = ("averager", "rng", "drift", "ft", "pacer")


class NoLivePeer(RuntimeError):
    """A restarted worker found no live peer to heal from (the others finished, or died)."""


def replica_name(rank: int) -> str:
    """torchft orders quorum members by id and reads trailing digits as ranks: zero-padded,
    the replicas sum in the same order as ranks do on the torch.distributed path."""
    return f"replica_{rank:03d}"


def replica_groups(ft: FtConfig, info: WorkerInfo) -> int:
    """How many replica groups the job has: one per machine under torchrun, else one per
    worker."""
    return ft.replica_groups or info.world_size


class FaultTolerance:
    """`ft=torchft` for one worker: its round driver (`rounds`) and what the loop does around
    it, with the methods of `localsgd.loop.local_rounds.LocalRounds` (the Synchroniser is given
    one or the other). Built by `build_sync.build_synchroniser`; the trainer only sees the
    Synchroniser."""

    checks_inside = True  # the replica checks run inside each round
    shared_checkpoints = True  # one state for every worker, right after a committed round

    def __init__(
        self,
        ft: FtConfig,
        info: WorkerInfo,
        rounds: FaultTolerantRounds,
        seed: int,
        sharded: bool = False,
        drift: RoundDriftMeter | None = None,
    ):
        self.ft, self.info, self.rounds, self.seed = ft, info, rounds, seed
        self.sharded = sharded  # the replica group's ranks hold shards: they write together
        self.drift = drift  # measured through the rounds (built here: it needs their comm)
        self.round_clock = RoundClock(ft.join_timeout_s)

    @classmethod
    def build(
        cls,
        ft: FtConfig,
        info: WorkerInfo,
        seed: int,
        averager,
        gradients,
        verify: bool,
        sharded: bool = False,
        batch: int = 0,
        drift: tuple | None = None,
    ) -> FaultTolerance:
        """`batch`: the samples one worker's optimizer step trains on (each replica group's
        step trains on `batch` x its ranks: `merged_samples` counts them). `drift`: the
        replica group's (replicate, shard) process groups to measure the drift over, with the
        rounds (`RoundDriftMeter`: then `drift` holds it); None: not measured."""
        group: dict[str, Any] = {}
        if ft.replica_groups is not None:  # torchrun: this machine's ranks are the replica group
            group = {**_group_store(), "rank": dist.get_rank(), "world_size": dist.get_world_size()}
        device = averager.flat.buffers[0].device if averager.flat.buffers else torch.device("cpu")
        gate = heartbeat_gate(ft)  # it heartbeats only while healthy (None: torchft's own)
        manager = make_manager(
            replica_id=ft.replica_id or replica_name(info.rank),
            lighthouse=ft.lighthouse,
            min_replicas=ft.min_replicas,
            host=ft.host,
            timeout_s=ft.timeout_s,
            quorum_timeout_s=ft.quorum_timeout_s,
            connect_timeout_s=min(ft.timeout_s, 10.0),
            device_type=device.type,
            gate=gate,
            on_gate_change=gate_notice(info.rank, ft),
            **group,
        )
        comm = TorchftCommunicator(
            manager,
            stats=averager.stats,
            link=averager.comm.link,
            replicas=replica_groups(ft, info),
            device=device,
            grace=grace_window(ft),
            worker=info.rank,
            gate=gate,
        )
        group_size = info.world_size // replica_groups(ft, info)
        rounds = FaultTolerantRounds(
            averager,
            comm,
            gradients=gradients,
            check_replicas=verify,
            stop_requested=signalled,
            samples_per_step=batch * group_size,
            retry_failed=ft.retry_failed_sync,
        )
        if gate is not None:  # an optimizer step is progress
            gate.watch(lambda: averager.step)
        meter = None
        if drift is not None:
            meter = RoundDriftMeter(averager.flat.buffers, comm, *drift)
            rounds.round_ended.append(meter.round_ended)
        return cls(ft, info, rounds, seed, sharded, meter)

    # --- the first round -----------------------------------------------------------------------

    def join(
        self, registry: Mapping[str, Any], optimizer_step: Callable[[], None], step: int, every: int
    ) -> str:
        """Before the first step: register the heal set, then the first round. A fresh worker
        waits until all W have joined; a restarted one heals from a live peer inside the round
        that peer is in and finishes it (`optimizer_step` takes a warmup step's optimizer step).
        Returns the round's phase ("fresh", "grad", "sync" or "average"); raises `NoLivePeer`
        for a restarted worker that found no peer ahead of it, which must not train."""
        rounds, info = self.rounds, self.info
        for key, component in registry.items():
            if key not in NOT_HEALED:
                rounds.register_state(key, _heal_state(component), _heal_loader(key, component))
        if every > 0:
            rounds.checkpoint_mark = step // every
        groups = replica_groups(self.ft, info)
        # A restarted worker waits for a quorum with a peer in it: alone in a quorum (its peers
        # still inside a round that timed out on its death) it would find nobody to heal from.
        wait_for = groups if info.attempt == 0 else min(groups, 2)
        with warnings.catch_warnings():
            # torch's checkpoint reader warns that the received bytes are read-only; they are
            # copied into this worker's own tensors at once
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            try:
                phase = rounds.start(wait_for=wait_for, timeout_s=self.ft.quorum_timeout_s)
            except TimeoutError:
                if info.attempt == 0:
                    raise
                phase = "fresh"  # no peer came within ft.quorum_timeout_s
        if phase == "fresh" and info.attempt > 0:
            # restarted, and no peer was ahead of it: the others finished (or all died); training
            # alone from step 0 would add nothing to the job
            raise NoLivePeer(
                f"worker {info.rank} restarted but found no live peer to heal from; it stops"
            )
        if phase == "fresh":
            return phase
        torch.manual_seed(self.seed + 1000 * info.rank + 1 + 7919 * info.attempt)
        if phase == "grad":  # the peer is inside the warmup step's gradient average
            optimizer_step()
        return phase

    # --- the round driver's methods ----------------------------------------------------------

    @property
    def worker(self) -> int:
        return self.info.rank

    @property
    def comms(self) -> tuple:
        return (self.rounds.comm,)

    def stepped(self) -> None:
        self.rounds.stepped()

    def all_reduce_gradients(self) -> bool:
        return self.rounds.all_reduce_gradients()

    def maybe_average(self) -> None:
        self.rounds.maybe_average()

    def average(self) -> bool:
        return self.rounds.average()

    @property
    def speaks(self) -> bool:
        """The replica that led the last committed round names what every replica saw."""
        return self.rounds.leads

    @property
    def replica_checks(self) -> int:
        return self.rounds.replica_checks

    @property
    def rolled_back(self) -> bool:
        """A round found no quorum and put the whole model back to the last global state."""
        return self.rounds.quorum_lost is not None and not self.rounds.undo

    def checkpoint(
        self,
        step: int,
        max_steps: int,
        every: int,
        stop,
        save: Callable[..., str],
        final: bool,
        in_sync: bool,
        shared: bool,
        save_shared: Callable[[bool], str],
        make_common: Callable[[], bool],
    ) -> bool:
        """After a committed round: a shared checkpoint when due or at an agreed stop
        (`_checkpoint`); a stop between syncs first brings every worker onto one model with a
        blocking average round (Streaming DiLoCo's workers are never all in sync; the stop
        waits for the next round if it fails)."""
        rounds = self.rounds
        if rounds.stop_agreed and rounds.just_committed and not in_sync and not final:
            shared = make_common() or shared
        return self._checkpoint(
            step, final or step >= max_steps, every, shared, save_shared, make_common
        )

    def writes_results(self, rank: int) -> bool:
        """The first live replica group's rank 0: rank 0 unless it was lost."""
        return self.rounds.leads and dist.get_rank() == 0

    def evaluates_final(self, rank: int, sharding) -> bool:
        return self.rounds.leads

    def record(self) -> dict[str, Any]:
        """How many workers the last average included (every log line)."""
        return {"participants": self.rounds.participants}

    def summary(self) -> dict[str, Any]:
        rounds = self.rounds
        return {
            "participants": rounds.participants,
            "participants_min": rounds.participants_min,
            "heals": rounds.heals_seen,  # of any worker, counted alike by every worker
            "failed_syncs": rounds.failed_syncs,
            "retried_syncs": rounds.retried,  # failed syncs retried at once that committed
            # rounds that ran out of their grace window here, what they waited, the window
            "grace_timeouts": rounds.comm.timeouts,
            "grace_waited_s": round(rounds.comm.waited_s, 3),
            "grace_s": round(rounds.comm.grace.seconds(), 3) if rounds.comm.grace else None,
            "gate_closes": rounds.comm.gate.closes,  # times this worker stopped heartbeating
            # samples whose training reached a committed global state, all workers'
            "merged_samples": rounds.merged_samples,
        }

    def checkpoint_state(self) -> dict[str, Any]:
        return {"ft": self.rounds}  # its counters

    # --- after each step -----------------------------------------------------------------------

    def _checkpoint(
        self,
        step: int,
        final: bool,
        every: int,
        shared: bool,
        save: Callable[[bool], str],
        make_common: Callable[[], bool] = lambda: False,
    ) -> bool:
        """After a step (or the final average): a shared checkpoint when one is due and a round
        just committed, or when a stop was agreed in it (then True: stop); after a round that
        found no quorum, the stop checkpoint, then `QuorumLost`. `shared`: every worker holds a
        common state to write now (in sync, or the global state between syncs); where none
        does (eager outer steps, plain streaming) a due checkpoint first brings them together
        with `make_common()`, a blocking average as a round of its own (True when it
        committed). `save(writes)` is called on every worker for a checkpoint; `writes`: this
        process writes it."""
        rounds = self.rounds
        committed, rounds.just_committed = rounds.just_committed, False
        if committed and (line := self.round_clock.committed()) and self.writes_results(0):
            notice(line)
        if rounds.quorum_lost is not None:
            why, rounds.quorum_lost = rounds.quorum_lost, None
            ft = self.ft
            below = (
                f"fewer than ft.min_replicas={ft.min_replicas} replica groups for "
                f"ft.quorum_timeout_s={ft.quorum_timeout_s:g} at step {step} ({why})"
            )
            if not shared:  # a fragment's sync undone: the workers hold their own values
                raise QuorumLost(
                    f"{below}; stopped without a checkpoint of this state (these workers hold no "
                    "common state between syncs)"
                )
            # every surviving group writes (one folder wins whole)
            folder = save(self.writes_checkpoint(True)) or "its newest checkpoint"
            raise QuorumLost(
                f"{below}; stopped with the last global state in {folder}: run the same command "
                "to resume, at any dist.world_size"
            )
        if committed and rounds.stop_agreed and not final:
            if shared:
                save(self.writes_checkpoint(rounds.leads))
            return True
        if every <= 0 or not committed:
            return False
        mark = step // every
        if mark <= rounds.checkpoint_mark and not final:
            return False
        if not shared and not make_common():  # failed: the next committed round tries again
            return False
        rounds.checkpoint_mark = mark
        save(self.writes_checkpoint(rounds.leads))
        return False

    def writes_checkpoint(self, group_writes: bool) -> bool:
        """Whether this process writes a shared checkpoint that its replica group writes if
        `group_writes` (as this rank's own torchft Manager says): the group's rank 0; sharded,
        every rank of the group together (the DCP save is the group's collective), all taking
        the word of the group's rank 0 (one broadcast inside the group), so that no rank enters
        the collective alone."""
        if not self.sharded:
            return group_writes and dist.get_rank() == 0
        agreed = [bool(group_writes)]
        dist.broadcast_object_list(agreed, src=0)
        return agreed[0]

    def close(self) -> None:
        self.rounds.manager.shutdown(wait=False)


def _heal_state(component) -> Callable[[], Any]:
    """What a peer sends of `component`: its state_dict, with any DTensor (a sharded replica
    group's model and optimizer state, FSDP2's) as its local shard. A DTensor pickles with its
    device mesh, which names this process's groups: torchft's checkpoint transport cannot carry
    it, and the healer's rank r needs only the shard that the peer's rank r holds anyway."""
    return lambda: local_tree(component.state_dict())


def _heal_loader(key: str, component) -> Callable[[Any], None]:
    if key == "sampler":  # the peer's epoch and position, on this worker's own shard

        def load(state: dict[str, Any]) -> None:
            own = component.state_dict()
            component.load_state_dict({**state, "num_indices": own["num_indices"]})

        return load

    def load_shards(state: Any) -> None:
        # local shards back into DTensors laid out as this rank's own (same mesh and placements:
        # the peer's rank r held the same shard index)
        if isinstance(component, torch.optim.Optimizer):
            state = _optimizer_dtensors(state, component)
        else:
            state = into_dtensors(state, component.state_dict())
        component.load_state_dict(state)

    return load_shards


def _optimizer_dtensors(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A peer's optimizer state_dict with each per-parameter tensor shaped as that parameter's
    local shard made a DTensor like the parameter. Read from the parameters, not from this
    optimizer's own state: a restarted worker has taken no step, so it holds none."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for index, entries in state["state"].items():
        param = params[index]
        if is_dtensor(param):
            shape = param.to_local().shape
            entries = {
                k: as_dtensor_like(v, param)
                if isinstance(v, torch.Tensor) and v.dim() and v.shape == shape
                else v
                for k, v in entries.items()
            }
        out[index] = entries
    return {**state, "state": out}


def _group_store() -> dict[str, Any]:
    """A store for the Manager of this machine's ranks, new with every torchrun attempt: in
    torchrun's own store a restarted group would read the dead attempt's manager address.
    Hosted by rank 0 of the group on 127.0.0.1 (the group is one machine)."""
    store, box = None, [None]
    if dist.get_rank() == 0:
        store = serving_store("127.0.0.1")  # bound to the loopback only
        box = [store.port]
    dist.broadcast_object_list(box, src=0)
    _STORES.append(store)  # kept alive for the process's life
    return {"store_addr": "127.0.0.1", "store_port": box[0]}


_STORES: list[Any] = []

"""Sharded replica groups (`dist.shard_size` = S): the W workers as W/S replica groups of S
contiguous ranks. Inside a group the model is sharded with torch's FSDP2 (`fully_shard`, one
unit per block, then the root), so each rank holds 1/S of the parameters, gradients and
optimizer state, and FSDP reduces the gradients inside the group at every step. Local SGD /
DiLoCo run across the groups: each rank averages its own local shards with the ranks that hold
the same shard in the other groups (the mesh's "replicate" dimension), through the averagers'
mirror mode (`localsgd.averaging.averager`); the full model is never gathered to average it.

    mesh (W=4, S=2)          shard ->
                        rank 0  rank 1     replica group 0 (FSDP over ranks 0, 1)
         replicate |    rank 2  rank 3     replica group 1 (FSDP over ranks 2, 3)
                   v
    averaged together: {0, 2} (shard 0) and {1, 3} (shard 1)

S = 1 is the unsharded run: no mesh, no FSDP, every method a no-op, the default process group.
`state_bytes` says what a rank holds, sharded or not.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging import Averager
from localsgd.averaging.flat import is_dtensor
from localsgd.averaging.streaming.fragments import model_blocks
from localsgd.averaging.timeouts import inherit_timeout
from localsgd.averaging.trees import distinct_nbytes, tensors_in


class Sharding:
    """This rank's place in the replica groups, and the FSDP2 wrapping of its model."""

    def __init__(
        self,
        shard_size: int,
        world_size: int,
        device: torch.device,
        blocks_path: str | None = None,
    ):
        if shard_size < 1 or world_size % shard_size:
            raise ValueError(
                f"dist.shard_size must divide the world size ({world_size}), got {shard_size}"
            )
        self.size = shard_size
        self.blocks_path = blocks_path  # dist.shard_blocks: None, the automatic rule
        self.groups = world_size // shard_size
        self.mesh = None
        self.device = device
        if shard_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            # on the default process group, already initialised; collective over every rank
            self.mesh = init_device_mesh(
                device.type,
                (self.groups, shard_size),
                mesh_dim_names=("replicate", "shard"),
            )
            # torch gives a mesh's groups the backend's default timeout, not dist.timeout_s
            for dim in ("replicate", "shard"):
                inherit_timeout(self.mesh[dim].get_group())

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's shard in every group: where averages go (None: the
        default group, every rank, when unsharded)."""
        return None if self.mesh is None else self.mesh["replicate"].get_group()

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """This rank's replica group (FSDP's), or None when unsharded."""
        return None if self.mesh is None else self.mesh["shard"].get_group()

    def shard(
        self, model: nn.Module, precision: str = "32-true", compile: bool = False
    ) -> nn.Module:
        """`model` sharded inside the replica group: one FSDP2 unit per block
        (`model_blocks`, as Streaming DiLoCo's fragments and torchtitan split it, or the
        children of the submodule `dist.shard_blocks` names), then the
        root for the rest. Build the optimizer after this: the parameters become DTensors.

        `precision` (trainer.precision) as FSDP2's MixedPrecisionPolicy rather than autocast
        (`Recipe(sharded=True)` leaves autocast off, as torchtitan does): each unit is gathered
        in the low dtype and computes in it, its gradients are reduce-scattered in fp32, and the
        sharded parameters, their gradients, the optimizer state and all the averagers see stay
        fp32 (the master copy), as unsharded.

        `compile` (trainer.compile) compiles each block in place before it is sharded, as
        torchtitan does: FSDP's gathers and frees stay outside the compiled code, and the
        module keeps its state_dict keys. A
        block that is a bare torch.nn layer (the MLP's Linear) is left to run eagerly by
        torch.compile itself: it compiles only model code (GPT's Block)."""
        if self.mesh is None:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from localsgd.loop.recipe import PRECISIONS

        dtype = PRECISIONS[precision]
        policy = MixedPrecisionPolicy(dtype, reduce_dtype=torch.float32 if dtype else None)

        saved = model.state_dict().keys()  # persistent buffers: not a rotary embedding's
        floats = [n for n, b in model.named_buffers() if torch.is_floating_point(b) and n in saved]
        if floats:
            # FSDP2 leaves buffers whole and per rank: BatchNorm statistics would drift apart
            # inside a group, where nothing averages them (a non-persistent buffer, such as a
            # rotary embedding's frequencies, is a constant of the model: it may stay per rank)
            raise ValueError(
                f"a model with floating-point buffers ({floats[0]}: BatchNorm statistics) is "
                "not built with dist.shard_size > 1 yet"
            )
        # FSDP2 warns when the root returns a view (the transformer's head does), since an
        # in-place op on it would skip a hook; the loop only reads the logits
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        shard_mesh = self.mesh["shard"]
        for block in model_blocks(model, self.blocks_path):
            if compile:
                block.compile()
            fully_shard(block, mesh=shard_mesh, mp_policy=policy)
        fully_shard(model, mesh=shard_mesh, mp_policy=policy)
        return model

    def evaluates(self, rank: int) -> bool:
        """Whether this rank takes part in evaluating the model: rank 0 alone when unsharded,
        else every rank of the first replica group (FSDP's forward gathers each unit from
        all of them)."""
        return rank < self.size

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, gathered inside the replica group (a collective of the
        ranks that `evaluates`), for `model.pt`; None when unsharded (the module's own)."""
        if self.mesh is None:
            return None
        return {k: v.full_tensor() if is_dtensor(v) else v for k, v in model.state_dict().items()}

    def group_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` averaged over this rank's replica group (a collective of the group's ranks):
        each rank's is the loss of its part of the group's batch, and what a schedule adapts
        to must be the group's, the same on every shard index, or the replicate groups of
        different shards would average at different steps. `loss` itself when unsharded."""
        if self.mesh is None:
            return loss
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=self.shard_group)
        return mean.div_(self.size)

    def all_of(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank of this rank's replica group (one scalar
        all-reduce inside it): what the group does together, such as computing a tick's step
        under a time budget, where a rank that idled alone would leave FSDP's collectives
        waiting. `flag` itself when unsharded."""
        if self.mesh is None:
            return flag
        value = torch.tensor(int(flag), dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.shard_group)
        return bool(value.item())

    def group_sum(self, value: int) -> int:
        """`value` summed over this rank's replica group (one scalar all-reduce inside it, a
        collective of the group's ranks); `value` itself when unsharded."""
        if self.mesh is None:
            return value
        total = torch.tensor(value, dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.shard_group)
        return int(total.item())


def _optimizer_state(optimizers: Any) -> list[torch.Tensor]:
    opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    return [t for o in opts if o is not None for t in tensors_in(list(o.state.values()))]


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, averager: Averager) -> dict:
    """The bytes of training state this rank holds between steps, sharded or not: its
    parameters (local shards), their gradients (as held at the end of the last step), the inner
    optimizer's state, and the averager's own: the mirrored copy of the parameters (sharded
    runs: 0 between steps, where it is released; unsharded the flat buffers *are* the
    parameters' storage), anchors, outer momentum, error-feedback residuals, and `other` (wire
    buffers, fragments' in-flight copies). With `sync.outer_state=cpu` the anchors and outer
    momentum, and the host staging buffer of the outer step, are counted apart, in `host`
    (`total`, `anchors`, `outer_momentum`, `staging`), not in `total`: `total` is what the
    accelerator holds (on a CPU-only run the two are the same memory).

    Excluded: what exists only while a step runs (activations, FSDP's gathered parameters, the
    mirrored copy and drift's scratch during a step that acts, a replica check's copy) and the
    allocator's caches; the peak at a round is measured apart (experiments/bench/sharded.py)."""
    params = list(model.parameters())
    own, host = averager.held_bytes()
    parts = {
        "parameters": distinct_nbytes(params),
        "gradients": distinct_nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": distinct_nbytes(_optimizer_state(optimizer)),
        "averager": sum(own.values()),
    }
    out = {"total": sum(parts.values()), **parts, "averager_parts": own}
    if host is not None:
        out["host"] = {"total": sum(host.values()), **host}
    return out

"""The training recipe around one optimizer step, named as in Lightning's Trainer:
`trainer.precision`, `trainer.gradient_clip_val`, `trainer.accumulate_grad_batches` and
`trainer.compile`; and `trainer.activation_checkpointing` (`checkpoint_activations`).

Mixed precision only changes how the forward pass computes (torch.autocast): the parameters, the
gradients, the optimizer state and everything the averagers communicate stay fp32, so local SGD's
averages are as exact as without it. `16-mixed` adds a GradScaler per worker. In the synchronous
warmup the gradients are all-reduced while still scaled; every worker's scaler starts equal and
then sees the same reduced gradients, so the scalers stay in lockstep and all ranks skip the same
steps (as DDP with AMP does). After the warmup no gradient is shared and each scaler goes its way.

Sharded (`dist.shard_size` > 1) the precision is FSDP2's MixedPrecisionPolicy instead of autocast
(`Sharding.shard`), with the same fp32 master parameters. The GradScaler works on the sharded
gradients: torch reduces its found-inf flag over each DTensor's mesh (a max), so every rank of a
replica group skips the same steps, and FSDP's shards never part.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from localsgd.averaging.streaming.fragments import model_blocks

# trainer.precision -> the autocast dtype (None: plain fp32)
PRECISIONS: dict[str, torch.dtype | None] = {
    "32-true": None,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


def checkpoint_activations(model: torch.nn.Module, blocks_path: str | None = None) -> None:
    """Recompute each block's activations in the backward instead of keeping them
    (`torch.utils.checkpoint`, non-reentrant): peak memory of one block's activations at a
    time, for one more forward per step. Blocks as `model_blocks` finds them (a transformer's
    layers, as torchtitan wraps them). Done in place, by wrapping each block's `forward`, rather
    than with torch's `checkpoint_wrapper`, whose wrapper module renames every state_dict key;
    before `Sharding.shard`, so that FSDP's gather and free run around the checkpointed forward
    and its backward gathers the block again before the recomputation. The recomputation
    replays the RNG state (dropout draws the same mask), so the gradients are those without it."""
    from torch.utils.checkpoint import checkpoint

    for block in model_blocks(model, blocks_path):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


class Recipe:
    """What happens between "gradients zeroed" and "optimizer stepped", minus the data."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        precision: str = "32-true",
        gradient_clip_val: float | None = None,
        accumulate_grad_batches: int = 1,
        compile: bool = False,
        sharded: bool = False,
    ):
        if precision not in PRECISIONS:
            allowed = ", ".join(PRECISIONS)
            raise ValueError(f"trainer.precision must be one of {allowed}, got {precision!r}")
        if accumulate_grad_batches < 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches must be an integer >= 1, "
                f"got {accumulate_grad_batches!r}"
            )
        self.device_type = device.type
        # sharded: FSDP's policy casts the gathered parameters (and the inputs) already
        self.dtype = None if sharded else PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.clip = gradient_clip_val if gradient_clip_val else None  # 0 / None: no clipping
        self.accumulate = int(accumulate_grad_batches)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Compiled forward for training only: `model` itself stays the plain module, so its
        # state_dict keys, the averagers' views and checkpoints are the same with or without it.
        # Sharded, `Sharding.shard` compiled each block instead.
        self.forward = torch.compile(model) if compile and not sharded else model

    @classmethod
    def from_config(
        cls, model: torch.nn.Module, device: torch.device, trainer, sharded: bool = False
    ) -> Recipe:
        """From the `trainer` config (localsgd.config.TrainerConfig)."""
        return cls(
            model,
            device,
            precision=trainer.precision,
            gradient_clip_val=trainer.gradient_clip_val,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            compile=trainer.compile,
            sharded=sharded,
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()  # nothing at all on the default path
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss` already divided by `accumulate` (a mean over the micro-batches)."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale, clip and step; the scaler skips the step when a gradient overflowed."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # clipping must see the true gradient norm
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict | None:
        """The GradScaler's scale and growth counter: without them a resumed 16-mixed run would
        restart from the initial scale and diverge from the uninterrupted one."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

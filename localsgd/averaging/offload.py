"""The outer state off the accelerator (`outer_state="cpu"`).

DiLoCo's and SlowMo's anchor and outer momentum (`rounds.outer`: `Anchors`, `OuterSGD`), for the
whole model or each Streaming DiLoCo fragment, are two model-sized fp32 copies that the inner
steps never read: with
`outer_state="cpu"` they live in host memory, as torchft keeps its backups of the global
weights. They are laid out like the flat buffers, so in mirror mode (sharded replica groups)
they hold this rank's local shards only.

At an outer step the wire stays on the device (NCCL reduces device memory): the pseudo-gradient
`anchor - local` goes out from the device, its mean comes back to a host staging buffer, the
outer step runs there on the host anchor and momentum, and the new values go back to the
device. The pseudo-gradient is computed on the host too (`rounds.contribution`: the local values
copied down into the part's staging buffer, the difference copied up: no device scratch, four
part-sized copies a round), the whole model or a fragment alike.

Same bits as `outer_state="device"`: each value is computed by the same fp32 operation from the
same operands (a subtraction, the SGD step), only on another device, and copies are exact. On
a CPU-only run the two are the same memory, so the copies are pure overhead; on CUDA, the GPU's
SGD kernels may contract a multiply-add that the CPU's do not (the last bit of a value;
experiments/gpu_check/gpu_check.py reports the largest difference).

Host copies are pinned (page-locked) where CUDA is available, so copies to and from the GPU
go straight to that memory; pinning needs an accelerator (torch refuses it without one).
"""

from __future__ import annotations

import torch

OUTER_STATES = ("device", "cpu")


def check_outer_state(value: str) -> bool:
    """Whether `value` puts the outer state in host memory (`cpu`); ValueError if it is not one
    of OUTER_STATES."""
    if value not in OUTER_STATES:
        raise ValueError(f"outer_state must be one of {', '.join(OUTER_STATES)}, got {value!r}")
    return value == "cpu"


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory: pinned where CUDA is available (see the module doc)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return out.copy_(t.detach())


def host_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised host buffer shaped like `t` (pinned as `host_clone`): staging."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())

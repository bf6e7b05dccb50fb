"""A checksum of tensors' raw bits (`replica_checksum`): what "bit-identical" is checked by,
where the tensors themselves are not gathered (after a sync, `sync.check_replicas`; the hosted
syncer's global model against what each worker holds)."""

from __future__ import annotations

import torch


def replica_checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 sums over the raw bits (all words, odd-position words), accumulated without a
    converted copy: equal bits give equal sums, and any single changed word changes the first."""
    # on an accelerator when any tensor is (the gather that follows may be NCCL's): host anchors
    # (sync.outer_state=cpu) come first in Streaming DiLoCo's list; a CPU sum adds to it as a
    # scalar
    device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    for t in tensors:
        bits = t.detach().reshape(-1).view(_int_dtype(t.dtype))
        sums[0] += bits.sum(dtype=torch.int64)
        sums[1] += bits[1::2].sum(dtype=torch.int64)
    return sums


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]

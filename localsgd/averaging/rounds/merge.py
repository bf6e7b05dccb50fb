"""The last stage of a round: how a worker's values take the round's global values.

- `replace`: `local <- global` (DiLoCo's; with the values' mean, plain averaging);
- `mix`: `local <- alpha local + (1 - alpha) global` (Streaming DiLoCo's merge, alpha in [0, 1));
- `progress` (a launched round only): `local <- global + (local - local at the launch)`, the
  delayed averaging of DaSGD: the worker keeps what it trained while the round was in flight.
"""

from __future__ import annotations

import torch

from localsgd.averaging.rounds.part import Tensors

MERGE_RULES = ("mix", "progress")  # `sync.merge_rule`; mix with alpha 0 is `replace`


def keep_progress_(local: torch.Tensor, average: torch.Tensor, origin: torch.Tensor) -> None:
    """`local <- average + (local - origin)` (in this order of operations, which every delayed
    merge here shares)."""
    local.sub_(origin).add_(average)


def merge_(
    local: Tensors,
    glob: Tensors,
    alpha: float = 0.0,
    origins: Tensors | None = None,
) -> None:
    """Each of `local` takes its `glob`: kept progress since `origins` (given), a mix (alpha > 0),
    or a copy (nothing where the round ran in place: `local` is `glob`)."""
    for i, (here, there) in enumerate(zip(local, glob, strict=True)):
        if origins is not None:
            keep_progress_(here, there, origins[i])
        elif alpha:
            here.mul_(alpha).add_(there, alpha=1 - alpha)
        elif here.data_ptr() != there.data_ptr():  # in place: the round left it there
            here.copy_(there)

"""Replicas start together in the library too: an averager whose state is taken from the replicas
(an anchor) gives every rank rank 0's model when it is built, as DDP does, so that models built
under different seeds on different ranks meet at the first sync. Without that they never do."""

from __future__ import annotations

import pytest
import torch

from localsgd.averaging import (
    GradientAverager,
    HierarchicalAverager,
    OuterAverager,
    PeriodicAverager,
)
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow

STEPS = 12  # syncs after steps 0, 5, 10 (period 5)


def _build(kind: str, model: torch.nn.Module, init_sync: bool | None):
    opt = {} if init_sync is None else {"init_sync": init_sync}
    if kind == "diloco":  # docs/averaging-api.md's own-loop example, DiLoCo's outer step
        return OuterAverager(
            5, module=model, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True, **opt
        )
    if kind == "bf16_params":  # torch's way: the parameters given at the first call
        return PeriodicAverager(5, comm_dtype="bfloat16", **opt)
    if kind == "hierarchical_bf16":
        return HierarchicalAverager({5: 2}, module=model, comm_dtype="bfloat16", **opt)
    if kind == "gradients":  # synchronous SGD: averaged gradients from different starts
        return GradientAverager(model, **opt)
    raise ValueError(kind)


def _worker(rank, world_size, kind, init_sync):
    torch.manual_seed(100 + rank)  # each rank builds its model under its own seed, as people do
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    averager = _build(kind, model, init_sync)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    same_after_sync = []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(16, 4, generator=gen)
        model(x).square().mean().backward()
        if kind == "gradients":
            averager.all_reduce()
        opt.step()
        if kind == "bf16_params":
            averager.average_parameters(model.parameters())
        elif kind != "gradients":
            averager.maybe_average()
        if kind == "gradients" or step % 5 == 0:  # right after a sync
            same_after_sync.append([p.detach().clone() for p in model.parameters()])
    return same_after_sync


def _identical(results) -> list[bool]:
    """Per sync: whether both ranks hold bit-identical parameters."""
    a, b = results
    return [
        all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
        for pa, pb in zip(a, b, strict=True)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["diloco", "bf16_params", "hierarchical_bf16", "gradients"])
def test_models_built_under_different_seeds_are_identical_after_the_first_sync(kind):
    results = run_distributed(_worker, 2, kind, None)
    assert all(_identical(results)), kind


@pytest.mark.timeout(60)
def test_without_the_initial_broadcast_diloco_replicas_never_meet():
    """What the default prevents: the outer step moves each anchor by the same mean
    pseudo-gradient, so anchors that differ at construction stay apart at every sync."""
    results = run_distributed(_worker, 2, "diloco", False)
    assert not any(_identical(results))

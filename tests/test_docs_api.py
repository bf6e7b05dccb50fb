"""docs/averaging-api.md's library examples run as written, in one process (a gloo group of one
rank): the "Building blocks" assembly of `Rounds` is the averager its keywords build, bit for bit,
and the robust example reads verdicts where the averager keeps them (`averager.rounds.trust`)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import PeriodicAverager, TrustedRound

pytestmark = pytest.mark.timeout(60)

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "averaging-api.md")  # fmt: skip


def _block(marker: str) -> str:
    """The doc's one ```python block that holds `marker`."""
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} python blocks of {DOC} hold {marker!r}"
    return found[0]


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, averager, steps: int = 9) -> torch.Tensor:
    """`steps` SGD steps on fixed data, the averager called after each (syncs after 0, 4, 8)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        averager.maybe_average()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_building_blocks_example_is_the_averager_its_keywords_build(lone_group):
    doc = {"model": _model()}
    exec(_block("def bfloat16_changes"), doc)
    ours = doc["averager"]
    built = PeriodicAverager(4, module=_model(), comm_dtype="bfloat16", error_feedback=True)
    plain = PeriodicAverager(4, module=_model())
    got = [_train(a.module, a) for a in (ours, built, plain)]
    assert torch.equal(got[0], got[1])
    assert all(
        torch.equal(a, b)
        for a, b in zip(ours.rounds.residuals[0], built.rounds.residuals[0], strict=True)
    )
    # the wire did round: the fp32 average (which, alone in the group, changes nothing) differs
    assert not torch.equal(got[0], got[2])
    assert any(r.abs().sum() > 0 for r in ours.rounds.residuals[0])


def test_the_robust_example_reads_the_verdicts_where_the_averager_keeps_them(lone_group):
    doc = {"model": _model(), "held_out_loss": lambda round_, samples=None: 0.0}
    exec(_block("trust.excluded"), doc)  # its last lines read the verdicts
    trust = doc["averager"].rounds.trust
    assert isinstance(trust, TrustedRound)
    assert trust.excluded == {} and trust.events == []
    assert trust.aggregate.rule == "trimmed_mean" and trust.judge.exclude_after == 2

"""The inner optimizer's state in asynchronous rounds (`sync.optimizer_state`): `reset` drops it
at every exchange, where the worker takes the newest global values, as at every synchronous
round; `average` and `desloc`, which average it in rounds every worker takes part in, are
refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import OptimizerStateSync
from localsgd.averaging.asynchronous import AsyncAverager
from localsgd.averaging.virtual import run_virtual
from tests.helpers import refusal

pytestmark = pytest.mark.timeout(60)


def _one_worker(rank, baton):
    """One worker (a virtual world of one, in-process), SGD with momentum, phases of 4 steps:
    after each step, whether it exchanged and how many parameters hold optimizer state."""
    dist.init_process_group("virtual", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        averager = AsyncAverager(
            4, module=model, store=dist.distributed_c10d._get_default_store(), run_id="reset",
            max_steps=12, step_s=1.0, timeout_s=30, outer_lr=0.7, outer_momentum=0.9,
        )  # fmt: skip
        averager.hooks.append(OptimizerStateSync(opt, "reset"))
        held = []
        for _ in range(12):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().sum().backward()
            opt.step()
            averager.trained(3)
            held.append((averager.maybe_average(), len(opt.state)))
        return held
    finally:
        dist.destroy_process_group()


def test_reset_drops_the_state_at_every_exchange_and_only_there():
    (held,) = run_virtual(_one_worker, 1, timeout_s=60)
    exchanged = [step for step, (acted, _) in enumerate(held) if acted]
    assert exchanged == [0, 4, 8, 11]  # after the first step, every 4, and the end's meeting
    assert all(count == (0 if acted else 2) for acted, count in held)


@pytest.mark.parametrize("mode", ["average", "desloc"])
def test_averaging_the_state_is_refused_in_one_line(mode, capsys):
    line = refusal(["sync.outer=diloco", "sync.mode=async", f"sync.optimizer_state={mode}"],
                   capsys)  # fmt: skip
    assert "sync.optimizer_state=average or desloc" in line and "reset" in line

"""`sync.optimizer_state=desloc` (DES-LOC): Adam's first and second moments averaged each at its
own multiple of the parameter period, their bytes counted per state, the clock checkpointed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import CommStats, OptimizerStateSync, PeriodicAverager
from localsgd.averaging.comm import Communicator
from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from localsgd.loop.strategies import build_averager, optimizer_state_bytes
from tests.helpers import compose_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _halving(stats: CommStats) -> Communicator:
    """One process posing as two without AVG: a mean divides by 2 and sums over one rank, so
    every tensor averaged through it is halved: what was averaged shows in the values."""
    comm = Communicator(None, stats)
    comm.use_avg, comm.size = False, 2
    return comm


def test_desloc_averages_each_moment_at_its_period_and_counts_its_bytes(lone_group):
    model, opt = _model_and_adam()
    hook = OptimizerStateSync(opt, "desloc", (2, 3))
    stats = CommStats()
    comm = _halving(stats)
    numel = sum(p.numel() for p in model.parameters())  # each moment: one value per parameter
    for r in range(1, 7):
        _step(model, opt, r)
        before = {k: [opt.state[p][k].clone() for p in model.parameters()]
                  for k in ("exp_avg", "exp_avg_sq")}  # fmt: skip
        sent = stats.bytes
        hook(comm)
        for key, period in (("exp_avg", 2), ("exp_avg_sq", 3)):
            now = [opt.state[p][key] for p in model.parameters()]
            halved = all(torch.equal(a, b / 2) for a, b in zip(now, before[key], strict=True))
            kept = all(torch.equal(a, b) for a, b in zip(now, before[key], strict=True))
            assert (halved, kept) == ((True, False) if r % period == 0 else (False, True)), (r, key)
        expected = 4 * numel * ((r % 2 == 0) + (r % 3 == 0))
        assert stats.bytes - sent == expected, r
    # rounds 2, 4, 6 sent the first moments, 3 and 6 the second
    assert hook.bytes_by_state == {"exp_avg": 3 * 4 * numel, "exp_avg_sq": 2 * 4 * numel}
    assert stats.bytes == 5 * 4 * numel


def test_the_config_attaches_desloc_its_clock_is_checkpointed_and_bytes_are_logged(lone_group):
    cfg = compose_config(["optim=adamw", "sync.optimizer_state=desloc", "sync.moment_periods=[2,4]",
                          "sync.period=1"])  # fmt: skip
    validate(cfg)
    model, opt = _model_and_adam()
    averager = build_averager(cfg.sync, model, opt, 1, 1, CommStats())
    (hook,) = averager.hooks
    assert (hook.mode, hook.moment_periods) == ("desloc", (2, 4))
    for seed in range(5):
        _step(model, opt, seed)
        averager.maybe_average()
    assert hook.averages == 5
    record = optimizer_state_bytes(averager)
    numel = sum(p.numel() for p in model.parameters())
    assert record == {"comm_bytes_exp_avg": 2 * 4 * numel, "comm_bytes_exp_avg_sq": 4 * numel}
    state = averager.state_dict()
    twin_model, twin_opt = _model_and_adam()
    twin = build_averager(cfg.sync, twin_model, twin_opt, 1, 1, CommStats())
    twin.load_state_dict(state)
    assert twin.hooks[0].averages == 5 and twin.hooks[0].bytes_by_state == hook.bytes_by_state
    plain = PeriodicAverager(1, module=model)  # no hook: nothing to log
    assert optimizer_state_bytes(plain) == {}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sync.optimizer_state=desloc", "sync.moment_periods=[3]"], "sync.moment_periods"),
        (["sync.optimizer_state=desloc", "sync.moment_periods=[0,6]"], "sync.moment_periods"),
    ],
)
def test_what_desloc_cannot_do_is_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(["dist.world_size=4", *overrides]))
    line = str(e.value)
    assert "\n" not in line and key in line, line

"""One reading of the sync config (`localsgd.loop.plan.SyncPlan`): the checks, the ft checks,
the reshard refusal and the averager factory agree, because they all ask the plan."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import CommStats, StreamingAverager
from localsgd.cli.checks import _get, validate
from localsgd.cli.fault_tolerance import validate_ft
from localsgd.cli.forkserver import TORCHRUN_VARS
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan, strategy_name
from localsgd.loop.strategies import build_averager
from tests.helpers import compose_config

pytestmark = pytest.mark.timeout(60)

LEVELS = "sync.levels=[{group_size: node, period: 4}, {group_size: world, period: 8}]"


def _torchrun(monkeypatch, world_size: int = 4, local: int = 2) -> None:
    for var, value in zip(
        TORCHRUN_VARS, ("0", str(world_size), "0", "127.0.0.1", "29500"), strict=True
    ):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


def test_ft_refuses_a_delay_that_reaches_the_widest_levels_next_fragment(monkeypatch):
    """The issue's config: τ = H/P of the widest level (8/4 = 2) passed every check when the ft
    check read H as `sync.period` (16), then a merge and the next launch fell on one step and
    the launch ran outside any torchft round. Refused in one line before any worker starts."""
    _torchrun(monkeypatch)
    cfg = compose_config(
        [
            LEVELS,
            "sync.outer=diloco",
            "sync.fragments=4",
            "sync.delay_steps=2",
            "ft=torchft",
            "ft.lighthouse=127.0.0.1:1",
            "ft.replica_id=group_0",
            "ft.replica_groups=2",
        ]
    )
    with pytest.raises(ConfigError, match=r"sync.delay_steps must be < sync.levels\[1\].period"):
        validate_ft(cfg, _get, 2)
    with pytest.raises(ConfigError, match="sync.delay_steps"):
        validate(cfg, world_size=4, local_world_size=2)


def test_the_streaming_period_is_the_widest_levels():
    plan = SyncPlan.of(compose_config([LEVELS, "sync.outer=diloco", "sync.fragments=4"]).sync)
    assert (plan.period, plan.spacing, plan.streaming) == (8, 2, True)
    assert plan.period_key == "sync.levels[1].period"


@pytest.mark.parametrize(
    "overrides, name",
    [
        ([LEVELS, "sync.outer=diloco"], "hierarchical_diloco"),
        ([LEVELS], "hierarchical"),
        (["sync.overlap=true"], "overlap"),
        (["sync.outer=diloco", "sync.fragments=2"], "streaming_diloco"),
        (["sync.fragments=2"], "streaming_average"),
    ],
)
def test_strategy_names_say_what_runs(overrides, name):
    assert strategy_name(compose_config(overrides).sync) == name


# Each: the plan's answers, then what the averager built from the same config does.
CASES = [
    ([], False, True),
    (["sync.outer=diloco"], False, True),
    (["sync.outer=diloco", "sync.fragments=2", "sync.period=4"], True, False),
    (["sync.outer=diloco", "sync.merge_alpha=0.5"], True, False),
    (["sync.outer=diloco", "sync.eager=true", "sync.period=2"], True, False),
    (["sync.overlap=true"], True, False),
    (["sync.outer=diloco", "sync.delay_steps=1", "sync.period=4"], True, True),
    (["sync.outer=diloco", "sync.delay_steps=1", "sync.fragments=2", "sync.period=4"], True, False),
]


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("overrides, streaming, in_sync", CASES)
def test_the_plan_and_the_averager_agree(lone_group, overrides, streaming, in_sync):
    """`streaming` and `in_sync_after_sync` are what the averager does: its class, and
    whether it reports every replica in sync after the first sync that merged."""
    sync = compose_config(overrides).sync
    plan = SyncPlan.of(sync)
    assert (plan.streaming, plan.in_sync_after_sync) == (streaming, in_sync)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = build_averager(sync, model, opt, 1, 1, CommStats())
    assert isinstance(averager, StreamingAverager) == streaming
    for _ in range(8):
        averager.maybe_average()
        if averager.merged or averager.all_in_sync:
            break
    assert averager.merged or averager.all_in_sync
    assert averager.all_in_sync == in_sync


def test_the_reshard_refusal_reads_the_plan():
    refusal = SyncPlan.of(compose_config(["sync.overlap=true"]).sync).reshard_refusal()
    assert refusal.startswith("sync.overlap=True")
    # error feedback's residuals move: each new worker gets their sum over the old world size
    ef = ["sync.outer=diloco", "sync.comm_dtype=int4", "sync.error_feedback=true"]
    assert SyncPlan.of(compose_config(ef).sync).reshard_refusal() is None
    assert SyncPlan.of(compose_config(["sync.outer=diloco"]).sync).reshard_refusal() is None

"""The `sync` strategy keys: experiment files compose and validate, bad combinations are refused
in one line (in `validate`, and from the CLI before any worker starts)."""

from __future__ import annotations

import pytest

from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan
from localsgd.loop.strategies import resolve_group_size
from tests.helpers import compose_config, refusal

LEVELS_OK = "sync.levels=[{group_size:2,period:2},{group_size:world,period:8}]"


@pytest.mark.parametrize(
    "name,expected",
    [
        ("hierarchical", {"levels": [{"group_size": 2, "period": 4}, {"group_size": "world"}]}),
        ("diloco", {"outer": "diloco"}),
        ("slowmo", {"outer": "slowmo"}),
        ("adaptive_period", {"schedule": "adaptive"}),
    ],
)
def test_experiment_files_compose_and_validate(name, expected):
    cfg = compose_config([f"+experiment={name}"])
    validate(cfg, world_size=4)
    for key, value in expected.items():
        if key == "levels":
            first = cfg.sync.levels[0]
            assert {"group_size": first.group_size, "period": first.period} == value[0]
            assert cfg.sync.levels[1].group_size == "world"
        else:
            assert getattr(cfg.sync, key) == value


@pytest.mark.parametrize(
    "overrides,world,key",
    [
        (["sync.levels=[{group_size:3,period:2},{group_size:world,period:8}]"], 6, None),
        (
            ["sync.levels=[{group_size:3,period:2},{group_size:world,period:8}]"],
            4,
            "sync.levels[0].group_size",
        ),
        (
            ["sync.levels=[{group_size:2,period:8},{group_size:world,period:8}]"],
            4,
            "sync.levels[1].period",
        ),
        (
            ["sync.levels=[{group_size:2,period:2},{group_size:3,period:8}]"],
            6,
            "sync.levels[1].group_size",
        ),
        (
            ["sync.levels=[{group_size:2,period:2},{group_size:4,period:8}]"],
            8,
            "sync.levels[1].group_size",
        ),
        # torch accepts equal sizes (its own 3-level test has 4 -> 4 then 8 -> 4): so do we
        (["sync.levels=[{group_size:node,period:2},{group_size:world,period:8}]"], 4, None),
        (
            [
                "sync.levels=[{group_size:2,period:2},{group_size:4,period:4},"
                "{group_size:world,period:8}]"
            ],
            4,
            None,
        ),
        (["sync.levels=[{group_size:4,period:2},{group_size:world,period:8}]"], 4, None),
        (
            [
                "sync.levels=[{group_size:2,period:2},{group_size:1,period:4},"
                "{group_size:world,period:8}]",
                "sync.comm_dtype=bfloat16",
            ],
            4,
            "sync.levels[1].group_size",
        ),
        ([LEVELS_OK, "sync.outer=diloco"], 4, None),  # the widest level's outer step
        ([LEVELS_OK, "sync.outer=diloco", "sync.optimizer_state=average"], 4, None),
        # one machine: every torchft replica group is one worker, so no inner level
        ([LEVELS_OK, "sync.outer=diloco", "ft=torchft"], 4, "ft=torchft with sync.levels"),
        ([LEVELS_OK, "sync.schedule=adaptive"], 4, None),  # the widest level's period adapts
        (["sync.comm_dtype=float64"], 4, "sync.comm_dtype"),
        (["sync.outer=adam"], 4, "sync.outer"),
        (["sync.optimizer_state=keep"], 4, "sync.optimizer_state"),
        (["sync.schedule=cyclic"], 4, "sync.schedule"),
        (["sync.schedule=adaptive", "sync.period=4", "sync.max_period=2"], 4, "sync.max_period"),
        (["sync.schedule=adaptive", "sync.period_factor=1"], 4, "sync.period_factor"),
        (["sync.outer=diloco", "sync.outer_lr=0"], 4, "sync.outer_lr"),
        (["sync.outer=slowmo", "sync.outer_momentum=1.0"], 4, "sync.outer_momentum"),
    ],
)
def test_validate_refuses_bad_strategy_settings(overrides, world, key):
    cfg = compose_config(overrides)
    if key is None:
        validate(cfg, world_size=world)
        return
    with pytest.raises(ConfigError, match=r"^" + key.replace("[", r"\[").replace("]", r"\]")):
        validate(cfg, world_size=world)


def test_node_level_resolves_to_local_world_size():
    cfg = compose_config(["sync.levels=[{group_size:node,period:2},{group_size:world,period:8}]"])
    # what build_averager gives the levels: node = torchrun's LOCAL_WORLD_SIZE, world = all
    assert [resolve_group_size(lv.group_size, 4, 2) for lv in cfg.sync.levels] == [2, 4]
    assert resolve_group_size("node", 4, None) == 4  # without torchrun: one machine, every rank
    validate(cfg, world_size=4, local_world_size=2)
    # validate resolves `node` by the same rule: 3 processes per machine do not divide 4 workers
    refused = r"^sync\.levels\[0\]\.group_size must be a divisor of 4 workers, got 3$"
    with pytest.raises(ConfigError, match=refused):
        validate(cfg, world_size=4, local_world_size=3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override,key",
    [
        (
            "sync.levels=[{group_size:3,period:2},{group_size:world,period:8}]",
            "sync.levels[0].group_size",
        ),
        ("sync.comm_dtype=float64", "sync.comm_dtype"),
    ],
)
def test_cli_refuses_bad_strategy_in_one_line(tmp_path, capsys, override, key):
    line = refusal([override, "dist.world_size=4", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert line.startswith(f"error: {key} ")
    assert not (tmp_path / "run").exists()


def _outer_warmups(rank, world_size, overrides_list):
    """What the trainer's averager holds of `sync.outer_warmup_rounds`, per config."""
    import torch

    from localsgd.averaging.comm import CommStats
    from localsgd.loop.strategies import build_averager

    out = []
    for overrides in overrides_list:
        cfg = compose_config(overrides)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        averager = build_averager(cfg.sync, model, opt, world_size, world_size, CommStats())
        outer = averager.rounds.outer
        out.append(None if outer is None else outer.warmup_rounds)
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_outer_warmup_reaches_the_averager_and_the_diloco_preset_has_it():
    from localsgd.cli.launch import run_on_workers

    (got,) = run_on_workers(
        _outer_warmups,
        1,
        [
            ["sync=diloco"],  # the preset: 4 rounds (the Shakespeare study's map)
            ["sync=diloco", "sync.outer_warmup_rounds=0"],  # the paper's step
            [
                "sync.outer=diloco",
                "sync.fragments=2",
                "sync.period=8",
                "sync.outer_warmup_rounds=3",
            ],  # per fragment under streaming
        ],  # fmt: skip
    )
    assert got == [4, 0, 3]


@pytest.mark.timeout(30)
def test_an_outer_step_without_momentum_takes_no_nesterov_unless_asked_and_then_refuses_it():
    # the DiLoCo preset's Nesterov follows its momentum (torch refuses the flag without one,
    # in a worker, after the launch); asked for explicitly, it is a one-line error first
    plan = SyncPlan.of(compose_config(["sync=diloco", "sync.outer_momentum=0"]).sync)
    assert (plan.outer_momentum, plan.outer_nesterov) == (0, False)
    assert SyncPlan.of(compose_config(["sync=diloco"]).sync).outer_nesterov is True
    asked = ["sync=diloco", "sync.outer_momentum=0", "sync.outer_nesterov=true"]
    with pytest.raises(ConfigError, match="sync.outer_nesterov must be false"):
        validate(compose_config(asked))

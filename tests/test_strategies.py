"""Averaging strategies: hierarchical, period schedules, outer optimizers, compression, optimizer
state. Each test would fail without the feature it names."""

from __future__ import annotations

import json
import tempfile
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)

from localsgd.averaging import (
    AdaptivePeriod,
    GradientAverager,
    HierarchicalAverager,
    OptimizerStateSync,
    OuterAverager,
    PeriodicAverager,
    StepPeriod,
)
from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import SMALL, CollectiveCounter, compose_config, run_distributed

pytestmark = pytest.mark.slow


def _model(bn: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    if bn:
        layers.insert(1, torch.nn.BatchNorm1d(16))
    return torch.nn.Sequential(*layers)


def _train_step(model, opt, gen) -> torch.Tensor:
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _flat(model) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()]).float()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _hierarchical_worker(rank, world_size, warmup, steps):
    levels = OrderedDict([(2, 2), (4, 4)])
    models = {k: _model() for k in ("ours", "torch", "bf16")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    ours = HierarchicalAverager(levels, warmup, module=models["ours"])
    reference = HierarchicalModelAverager(levels, warmup_steps=warmup)
    bf16 = HierarchicalAverager(levels, warmup, module=models["bf16"], comm_dtype="bfloat16")
    gens = {k: torch.Generator().manual_seed(100 + rank) for k in models}
    decisions, same_pair, same_all = [], [], []
    for _ in range(steps):
        for k in models:
            _train_step(models[k], opts[k], gens[k])
        decisions.append(ours.level_at(ours.step))
        ours.maybe_average()
        reference.average_parameters(models["torch"].parameters())
        bf16.maybe_average()
        replicas = _gather(_flat(models["bf16"]))
        same_pair.append(torch.equal(replicas[0], replicas[1]))
        same_all.append(all(torch.equal(replicas[0], r) for r in replicas[1:]))
    assert reference.step == ours.step == steps
    return {
        "ours": _flat(models["ours"]),
        "torch": _flat(models["torch"]),
        "bf16": _flat(models["bf16"]),
        "decisions": decisions,
        "levels": ours.comm_levels(),
        "bf16_levels": bf16.comm_levels(),
        "same_pair": same_pair,
        "same_all": same_all,
    }


@pytest.mark.timeout(120)
def test_hierarchical_matches_torch_and_bf16_keeps_groups_identical():
    warmup, steps = 3, 14
    results = run_distributed(_hierarchical_worker, 4, warmup, steps)
    # torch's rule: s >= warmup, the largest period dividing s (not s - warmup) wins
    expected = [
        None if s < warmup else 1 if s % 4 == 0 else 0 if s % 2 == 0 else None for s in range(steps)
    ]
    numel = _flat(_model()).numel()
    for r in results:
        assert r["decisions"] == expected
        torch.testing.assert_close(r["ours"], r["torch"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["bf16"], r["ours"], rtol=0, atol=2e-3)
        rounds = [expected.count(0), expected.count(1)]
        assert [lv["rounds"] for lv in r["levels"]] == rounds
        assert [lv["bytes"] for lv in r["levels"]] == [4 * numel * n for n in rounds]
        assert [lv["bytes"] for lv in r["bf16_levels"]] == [2 * numel * n for n in rounds]
        assert [(lv["group_size"], lv["period"]) for lv in r["levels"]] == [(2, 2), (4, 4)]
        # narrow syncs make pairs identical, only wide ones everyone; local steps make all differ
        assert r["same_pair"] == [d is not None for d in expected]
        assert r["same_all"] == [d == 1 for d in expected]
    # the last step (13) was local: replicas differ, so the closeness above is not vacuous
    assert not torch.equal(results[0]["ours"], results[1]["ours"])
    assert not torch.equal(results[0]["ours"], results[2]["ours"])


def _outer_worker(rank, world_size, steps):
    models = {k: _model(bn=True) for k in ("plain", "outer1", "diloco", "diloco_bf16")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    averagers = {
        "plain": PeriodicAverager(3, module=models["plain"]),
        "outer1": OuterAverager(
            3, module=models["outer1"], outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False
        ),
        "diloco": OuterAverager(3, module=models["diloco"]),
        "diloco_bf16": OuterAverager(3, module=models["diloco_bf16"], comm_dtype="bfloat16"),
    }
    gens = {k: torch.Generator().manual_seed(7 + rank) for k in models}
    identical = []
    for s in range(steps):
        if s == 5:  # between syncs: a restored copy must continue exactly
            models["resumed"] = _model(bn=True)
            averagers["resumed"] = OuterAverager(3, module=models["resumed"])
            models["resumed"].load_state_dict(models["diloco"].state_dict())
            averagers["resumed"].load_state_dict(averagers["diloco"].state_dict())
            opts["resumed"] = torch.optim.SGD(models["resumed"].parameters(), lr=0.1)
            gens["resumed"] = torch.Generator().set_state(gens["diloco"].get_state())
        for k in models:
            _train_step(models[k], opts[k], gens[k])
            averagers[k].maybe_average()
        identical.append(torch.equal(*_gather(_flat(models["diloco"]))))
    momentum = averagers["diloco"].outer_optimizer.state_dict()["state"][0]["momentum_buffer"]
    # The first sync after a warmup is a plain average: the anchor is still the initial model
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = OuterAverager(3, warmup_steps=4, module=model)
    grads = GradientAverager(model)
    gen = torch.Generator().manual_seed(rank)
    for s in range(5):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if averager.in_warmup:
            grads.all_reduce()
        opt.step()
        if s == 4:
            mean_local = _flat(model)
            dist.all_reduce(mean_local)
            mean_local /= world_size
        averager.maybe_average()
    return {
        "after_warmup": (_flat(model), mean_local),
        **{k: _flat(m) for k, m in models.items()},
        "identical": identical,
        "momentum": momentum.clone(),
        "bytes": {k: a.stats.bytes for k, a in averagers.items()},
    }


@pytest.mark.timeout(120)
def test_diloco_with_outer_lr_1_and_no_momentum_is_plain_averaging():
    steps = 10
    results = run_distributed(_outer_worker, 2, steps)
    for r in results:
        torch.testing.assert_close(r["outer1"], r["plain"], rtol=1e-5, atol=1e-6)
        # DiLoCo's Nesterov momentum really changes the trajectory ...
        assert (r["diloco"] - r["plain"]).abs().max() > 1e-3
        # ... its compressed pseudo-gradient stays close and moves half the bytes
        torch.testing.assert_close(r["diloco_bf16"], r["diloco"], rtol=0, atol=2e-2)
        assert r["bytes"]["diloco_bf16"] * 2 == r["bytes"]["diloco"] == r["bytes"]["plain"]
        assert r["identical"] == [s % 3 == 0 for s in range(steps)]
        assert torch.equal(r["resumed"], r["diloco"])
        torch.testing.assert_close(*r["after_warmup"], rtol=1e-5, atol=1e-6)
    # the outer state is the same on every rank
    assert torch.equal(results[0]["momentum"], results[1]["momentum"])


def _schedule_worker(rank, world_size, steps):
    model = _model()
    adaptive = PeriodicAverager(2, module=model, schedule=AdaptivePeriod(2, 1, 16, 2, 0.05))
    decisions, periods, local_periods = [], [], []
    local = AdaptivePeriod(2, 1, 16, 2, 0.05)  # what this rank alone would decide
    local_sum, local_count = 0.0, 0
    for s in range(steps):
        # the mean falls, then jumps; even ranks alone see it stall early, odd ones never
        base = 2.0 * 0.8 ** min(s, 20) + (0.3 if s > 40 else 0.0)
        loss = torch.tensor(base + (-1) ** rank * min(s, 30) / 30)
        adaptive.observe_loss(loss)
        local_sum += float(loss)
        local_count += 1
        decisions.append(adaptive.maybe_average())
        if decisions[-1]:
            local.update(local_sum / local_count)
            local_sum, local_count = 0.0, 0
        periods.append(adaptive.period)
        local_periods.append(local.period)
    step_model = _model()
    stepped = PeriodicAverager(2, module=step_model, schedule=StepPeriod(2, 4, [6]))
    step_decisions = [stepped.maybe_average() for _ in range(22)]
    return decisions, periods, local_periods, step_decisions


@pytest.mark.timeout(120)
def test_schedule_decisions_are_identical_on_every_rank():
    results = run_distributed(_schedule_worker, 4, 60)
    decisions, periods = results[0][0], results[0][1]
    assert all(r[0] == decisions and r[1] == periods for r in results)
    assert max(periods) > 2 and min(periods[30:]) < max(periods)  # grew, then shrank
    # from local losses alone the ranks would have chosen different periods
    assert len({tuple(r[2]) for r in results}) > 1
    # step schedule: k=2 until step 6, then 8 (since the last average at step 4)
    assert [s for s, d in enumerate(results[0][3]) if d] == [0, 2, 4, 12, 20]


def _state_worker(rank, world_size):
    out = {}
    for mode in ("local", "average", "reset"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        averager = PeriodicAverager(4, module=model)
        averager.hooks.append(OptimizerStateSync(opt, mode))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(5):  # syncs after steps 0 and 4, the last step
            _train_step(model, opt, gen)
            averager.maybe_average()
        states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
        flat = torch.cat([t.reshape(-1) for t in states]) if states else torch.zeros(0)
        out[mode] = {"state": flat, "bytes": averager.stats.bytes, "numel": averager.flat.numel}
    return out


@pytest.mark.timeout(120)
def test_optimizer_state_policies():
    results = run_distributed(_state_worker, 2)
    for mode in ("local", "average", "reset"):
        a, b = results[0][mode], results[1][mode]
        if mode == "reset":
            assert a["state"].numel() == 0 and b["state"].numel() == 0
        else:
            assert torch.equal(a["state"], b["state"]) == (mode == "average")
        # AdamW's exp_avg and exp_avg_sq ride along with the parameters when averaged
        per_sync = 4 * a["numel"] * (3 if mode == "average" else 1)
        assert a["bytes"] == 2 * per_sync


def _diloco_adamw_worker(rank, world_size, cfg):
    """DiLoCo as the paper runs it: inner AdamW, an outer Nesterov step every H steps."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            cfg, WorkerInfo(rank, world_size, rank, world_size), torch.device("cpu"), run_dir
        )
        out = []
        for step in range(cfg.trainer.max_steps):
            before = trainer.sync.averager.flat.buffers[0].clone()
            trainer.train_step(step)
            params = torch.cat([b.reshape(-1) for b in trainer.sync.averager.flat.buffers])
            adam = torch.cat(
                [v.reshape(-1) for st in trainer.optimizer.state.values()
                 for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
            )  # fmt: skip
            out.append(
                {
                    "synced": trainer.in_sync,
                    "params_same": all(torch.equal(params, g) for g in _gather(params)),
                    "adam_same": all(torch.equal(adam, g) for g in _gather(adam)),
                    "moved": not torch.equal(before, trainer.sync.averager.flat.buffers[0]),
                }
            )
        return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["local", "average"])
def test_diloco_with_inner_adamw_keeps_adam_state_local_unless_asked(state):
    h, steps = 4, 9
    cfg = compose_config(
        SMALL
        + ["optim=adamw", "sync=diloco", f"sync.period={h}", f"trainer.max_steps={steps}"]
        + [f"sync.optimizer_state={state}"]
    )
    assert cfg.sync.outer == "diloco" and cfg.optim.betas == [0.9, 0.95]
    assert cfg.optim.weight_decay == 0.1
    per_rank = run_distributed(_diloco_adamw_worker, 2, cfg)
    for rank_steps in per_rank:
        synced = [s for s, r in enumerate(rank_steps) if r["synced"]]
        assert synced == [0, 4, 8]  # torch's step rule: after steps 0, H, 2H
        for s, r in enumerate(rank_steps):
            # after every outer step all replicas hold the new anchor, and between them they differ
            assert r["params_same"] == (s in synced)
            # the paper keeps each worker's Adam moments its own; `average` shares them at a sync
            assert r["adam_same"] == (state == "average" and s in synced)
            assert r["moved"]


def _trainer_worker(rank, world_size, configs):
    out = []
    for cfg in configs:
        with tempfile.TemporaryDirectory() as run_dir:
            info = WorkerInfo(rank, world_size, rank, world_size)
            trainer = Trainer(cfg, info, torch.device("cpu"), run_dir)
            per_step, in_sync, same_all = [], [], []
            for step in range(cfg.trainer.max_steps):
                with CollectiveCounter() as counter:
                    trainer.train_step(step)
                per_step.append(counter.count)
                in_sync.append(trainer.in_sync)
                flat = torch.cat([b.reshape(-1) for b in trainer.sync.averager.flat.buffers])
                same_all.append(all(torch.equal(flat, g) for g in _gather(flat)))
            out.append(
                {
                    "per_step": per_step,
                    "in_sync": in_sync,
                    "same_all": same_all,
                    "levels": trainer.sync.averager.comm_levels(),
                    "rounds": trainer.comm_stats.rounds,
                }
            )
    return out


@pytest.mark.timeout(180)
def test_trainer_with_hierarchical_levels_and_adaptive_period():
    steps = 18
    hierarchical = compose_config(
        SMALL
        + [
            f"trainer.max_steps={steps}",
            "sync.levels=[{group_size:2,period:2},{group_size:world,period:8}]",
        ]
    )
    adaptive = compose_config(
        SMALL
        + [f"trainer.max_steps={steps}", "sync.schedule=adaptive", "sync.period=2"]
        + ["sync.optimizer_state=average", "sync.comm_dtype=bfloat16"]
    )
    results = run_distributed(_trainer_worker, 4, [hierarchical, adaptive])
    level = [1 if s % 8 == 0 else 0 if s % 2 == 0 else None for s in range(steps)]
    for hier, _ in results:
        # one all-reduce a sync, plus drift's scalar one at a global sync
        assert hier["per_step"] == [int(lv is not None) + int(lv == 1) for lv in level]
        assert hier["in_sync"] == hier["same_all"] == [lv == 1 for lv in level]
        assert [lv["rounds"] for lv in hier["levels"]] == [level.count(0), level.count(1)]
    adaptive_runs = [r[1] for r in results]
    # one all-reduce for the parameters (and the piggybacked loss), one for the optimizer state,
    # one scalar for the drift
    assert all(c in (0, 3) for c in adaptive_runs[0]["per_step"])
    assert all(r["per_step"] == adaptive_runs[0]["per_step"] for r in adaptive_runs)
    assert adaptive_runs[0]["in_sync"] == adaptive_runs[0]["same_all"]
    assert adaptive_runs[0]["rounds"] == sum(adaptive_runs[0]["in_sync"])


@pytest.mark.long  # make test-long: DiLoCo's exact resume stays (tests/test_comm_frontier_cli.py)
@pytest.mark.timeout(300)
def test_diloco_adaptive_bf16_run_resumes_bit_identical_after_a_kill(tmp_path):
    from tests.helpers import BASE, killed_and_resumed

    args = BASE + [
        "sync.warmup_steps=0",
        "sync.period=2",
        "sync.schedule=adaptive",
        "sync.outer=diloco",
        "sync.comm_dtype=bfloat16",
        "sync.optimizer_state=average",
    ]
    reference, run_dir = killed_and_resumed(args, tmp_path)
    ours = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    for key in ("comm_rounds", "comm_bytes", "comm_levels", "test_accuracy"):
        assert ours[key] == ref[key], key

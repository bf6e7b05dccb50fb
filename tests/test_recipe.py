"""The training recipe (localsgd/loop/recipe.py): mixed precision, gradient clipping, gradient
accumulation, torch.compile, and the GradScaler in checkpoints."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch
import torch.distributed as dist

from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import FAST, CollectiveCounter, compose_config, run_cli, run_distributed

pytestmark = pytest.mark.slow

TINY = [
    "data=synthetic",
    "data.num_samples=800",
    "model=mlp",
    "model.hidden=[32]",
    "trainer.progress=false",
    "trainer.eval_every=1000",
    "trainer.track_drift=false",
    "logger.wandb.mode=disabled",
]


def _trainer(cfg, rank: int, world_size: int, run_dir: str, resume: str | None = None):
    info = WorkerInfo(rank, world_size, rank, world_size)
    return Trainer(cfg, info, torch.device("cpu"), run_dir, resume_from=resume)


def _flat(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _identical(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out[1:])


def _accumulation_worker(rank, world_size, accumulated, large, steps):
    with tempfile.TemporaryDirectory() as run_dir:
        a = _trainer(accumulated, rank, world_size, run_dir)
        initial = _flat(a).clone()
        per_step, positions = [], []
        for step in range(steps):
            with CollectiveCounter() as counter:
                a.train_step(step)
            per_step.append(counter.count)
            positions.append(a.sampler.position)
        b = _trainer(large, rank, world_size, run_dir)
        for step in range(steps):
            b.train_step(step)
        return {
            "per_step": per_step,
            "positions": positions,
            "accumulated": _flat(a),
            "large": _flat(b),
            "initial": initial,
        }


@pytest.mark.timeout(120)
def test_accumulating_two_batches_is_one_batch_twice_as_large_and_period_counts_steps():
    steps, period, warmup = 7, 3, 2
    common = TINY + [f"sync.period={period}", f"sync.warmup_steps={warmup}"]
    common += [f"trainer.max_steps={steps}"]
    accumulated = compose_config(
        common + ["trainer.batch_size=8", "trainer.accumulate_grad_batches=2"]
    )
    large = compose_config(common + ["trainer.batch_size=16"])
    results = run_distributed(_accumulation_worker, 2, accumulated, large, steps)
    # Sync rounds follow optimizer steps, not batches: a gradient all-reduce at each warmup
    # step, an average at s = 2, 5, as without accumulation.
    expected = [int(s < warmup or (s - warmup) % period == 0) for s in range(steps)]
    for r in results:
        assert r["per_step"] == expected
        assert r["positions"] == [16 * (s + 1) for s in range(steps)]  # two batches of 8 a step
        # the mean loss over two batches of 8 has the gradient of one batch of 16 (summation
        # order differs, hence a tolerance)
        assert torch.allclose(r["accumulated"], r["large"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(r["accumulated"], r["initial"])  # it did train


def _precision_worker(rank, world_size, cfg):
    with tempfile.TemporaryDirectory() as run_dir:
        t = _trainer(cfg, rank, world_size, run_dir)
        losses, identical_after_sync = [], []
        for step in range(cfg.trainer.max_steps):
            losses.append(float(t.train_step(step)))
            if t.in_sync:
                identical_after_sync.append(_identical(_flat(t)))
        dtypes = {p.dtype for p in t.model.parameters()}
        dtypes |= {p.grad.dtype for p in t.model.parameters() if p.grad is not None}
        dtypes |= {getattr(torch, d.removeprefix("torch.")) for d in t.sync.buffer_dtypes}
        dtypes |= {v.dtype for s in t.optimizer.state.values() for v in s.values() if v.dim()}
        scaler = t.recipe.scaler.get_scale() if t.recipe.scaler is not None else None
        return {
            "losses": losses,
            "identical": identical_after_sync,
            "dtypes": dtypes,
            "accuracy": t.evaluate()["val_accuracy"],
            "scale": scaler,
        }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_learns_with_fp32_parameters_and_averages(precision):
    cfg = compose_config(
        TINY
        + [
            f"trainer.precision={precision}",
            "trainer.batch_size=16",
            "trainer.max_steps=40",
            "sync.period=4",
            "sync.warmup_steps=3",
        ]
    )
    results = run_distributed(_precision_worker, 2, cfg)
    for r in results:
        # autocast computes in low precision; what is stored, stepped and averaged is fp32
        assert r["dtypes"] == {torch.float32}
        assert r["identical"] and all(r["identical"])  # averages are exact across replicas
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert last < 0.7 * first, r["losses"]
        assert r["accuracy"] > 0.5  # ten classes: chance is 0.1
        assert (r["scale"] is not None) == (precision == "16-mixed")


def _clip_worker(rank, world_size, clipped, plain):
    out = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, cfg in (("clipped", clipped), ("plain", plain)):
            t = _trainer(cfg, rank, world_size, run_dir)
            before = _flat(t).clone()
            t.train_step(0)
            out[name] = float((_flat(t) - before).norm())
    return out


@pytest.mark.timeout(90)
def test_gradient_clip_val_bounds_the_gradient_norm():
    # plain SGD at lr 1 with a constant schedule: the update is minus the (clipped) gradient
    base = TINY + ["optim.lr=1.0", "optim.momentum=0", "optim.weight_decay=0"]
    base += ["lr_schedule=constant", "trainer.batch_size=16"]
    (r,) = run_distributed(
        _clip_worker,
        1,
        compose_config(base + ["trainer.gradient_clip_val=0.001"]),
        compose_config(base),
    )
    assert r["plain"] > 0.01
    assert r["clipped"] == pytest.approx(0.001, rel=1e-3)


def _scaler_worker(rank, world_size, cfg):
    with tempfile.TemporaryDirectory() as run_dir:
        t = _trainer(cfg, rank, world_size, run_dir)
        t.train_step(0)
        t.step = 1
        t.recipe.scaler.update(new_scale=1024.0)  # as after a few overflowed steps
        t.save_checkpoint()
        t.train_step(1)
        folder = f"{run_dir}/checkpoints/step-1"
        resumed = _trainer(cfg, rank, world_size, run_dir, resume=folder)
        scale = resumed.recipe.scaler.get_scale()
        resumed.train_step(1)
        return {"scale": scale, "same": torch.equal(_flat(t), _flat(resumed))}


@pytest.mark.timeout(90)
def test_grad_scaler_state_is_checkpointed_and_restored():
    cfg = compose_config(
        TINY + ["trainer.precision=16-mixed", "trainer.batch_size=16", "trainer.max_steps=4"]
    )
    (r,) = run_distributed(_scaler_worker, 1, cfg)
    assert r["scale"] == 1024.0  # not the initial 65536
    assert r["same"]


def _compile_worker(rank, world_size, compiled, eager):
    out = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, cfg in (("compiled", compiled), ("eager", eager)):
            t = _trainer(cfg, rank, world_size, run_dir)
            for step in range(3):
                t.train_step(step)
            out[name] = _flat(t)
            out[f"{name}_type"] = type(t.recipe.forward).__name__
            out[f"{name}_keys"] = list(t.model.state_dict())  # what checkpoints and model.pt hold
    return out


@pytest.mark.long  # make test-long: the sharded recipe's compile stays (test_sharded_recipe.py)
@pytest.mark.timeout(240)
def test_compile_trains_the_same_model_through_torch_compile():
    base = TINY + ["trainer.batch_size=16", "trainer.max_steps=3"]
    (r,) = run_distributed(
        _compile_worker,
        1,
        compose_config(base + ["trainer.compile=true"]),
        compose_config(base),
        timeout_s=200,
    )
    assert r["compiled_type"] == "OptimizedModule" and r["eager_type"] != "OptimizedModule"
    assert torch.allclose(r["compiled"], r["eager"], rtol=1e-4, atol=1e-6)
    assert r["compiled_keys"] == r["eager_keys"]  # no `_orig_mod.` prefix in checkpoints


@pytest.mark.timeout(180)
def test_cli_bf16_mixed_with_accumulation_and_clipping_learns(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        FAST
        + [
            "trainer.precision=bf16-mixed",
            "trainer.accumulate_grad_batches=2",
            "trainer.gradient_clip_val=1.0",
            "trainer.max_steps=40",
            "trainer.log_every=10",
            "sync.period=8",
            "dist.world_size=2",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy"] > 0.5
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["samples"] == 10 * 32 * 2 * 2  # steps x batch x accumulated batches x workers


@pytest.mark.timeout(300)
def test_16_mixed_run_killed_mid_run_resumes_bit_identical(tmp_path):
    from tests.helpers import BASE, killed_and_resumed

    args = BASE + ["trainer.precision=16-mixed", "trainer.accumulate_grad_batches=2"]
    _, run_dir = killed_and_resumed(args, tmp_path)
    state = torch.load(run_dir / "checkpoints" / "step-24" / "rank-0.pt", weights_only=True)
    assert state["scaler"]["scale"] > 0  # the GradScaler's state is in every checkpoint


def _lockstep_worker(rank, world_size, cfg):
    from tests.faults import Fault

    with tempfile.TemporaryDirectory() as run_dir:
        t = _trainer(cfg, rank, world_size, run_dir)
        t.callbacks.append(Fault("nan:1:2"))  # rank 1's gradients overflow at warmup step 2
        scales, identical = [], []
        for step in range(4):
            before = _flat(t).clone()
            t.train_step(step)
            scales.append(t.recipe.scaler.get_scale())
            identical.append(_identical(_flat(t)))
            if step == 2:
                skipped = torch.equal(before, _flat(t))
        return {"scales": scales, "identical": identical, "skipped": skipped}


@pytest.mark.timeout(90)
def test_16_mixed_scalers_stay_in_lockstep_through_an_overflow_in_the_warmup():
    cfg = compose_config(
        TINY + ["trainer.precision=16-mixed", "trainer.batch_size=16", "sync.warmup_steps=4"]
    )
    results = run_distributed(_lockstep_worker, 2, cfg)
    for r in results:
        # the all-reduced gradient overflowed on both ranks: both skip that step and halve
        assert r["skipped"]
        assert r["scales"] == [65536.0, 65536.0, 32768.0, 32768.0]
        assert all(r["identical"])

"""`python -m localsgd.train` as a user runs it: outputs on disk, exit codes, refused input."""

from __future__ import annotations

import json
import math

import pytest
import torch

import localsgd
from localsgd.models import build_model
from tests.helpers import FAST, refusal, run_cli


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_post_local_sgd_run_writes_model_summary_and_metrics(tmp_path):
    steps, warmup, period, world = 40, 10, 8, 2
    run_dir = tmp_path / "run"
    proc = run_cli(
        FAST
        + [
            f"trainer.max_steps={steps}",
            f"sync.warmup_steps={warmup}",
            f"sync.period={period}",
            f"dist.world_size={world}",
            "trainer.log_every=5",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked semaphore" not in proc.stderr  # workers leave by os._exit: nothing held

    summary = json.loads((run_dir / "summary.json").read_text())
    # warmup: one gradient all-reduce per step; then averages at s = 10, 18, 26, 34; the last
    # step (39) was local, so one final average.
    averages = math.ceil((steps - warmup) / period)
    assert summary["comm_rounds"] == warmup + averages + 1
    assert summary["comm_bytes"] == 4 * summary["params"] * summary["comm_rounds"]
    assert summary["steps"] == steps and summary["world_size"] == world
    assert 0.0 <= summary["test_accuracy"] <= 1.0 and summary["test_loss"] > 0
    assert summary["wall_time_s"] > 0
    assert summary["test_accuracy"] > 0.5  # ten classes: well above chance after 40 steps

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(5, steps + 1, 5))
    assert all({"lr", "comm_rounds", "comm_bytes"} <= r.keys() for r in train)
    assert train[1]["comm_rounds"] == 10  # after 10 steps: 10 warmup all-reduces, no average yet
    assert any("test_accuracy" in r for r in records)

    state = torch.load(run_dir / "model.pt", weights_only=True)
    model = build_model({"_target_": "localsgd.models.mlp", "hidden": [64]}, (32,), 10)
    model.load_state_dict(state)
    assert sum(v.numel() for v in state.values()) == summary["params"]
    log = (run_dir / "train.log").read_text()  # what the console showed, besides the notices
    assert f"[OUTPUT] - run dir: {run_dir}\n" in log and "[OUTPUT] - summary: " in log
    loaded = localsgd.load(str(run_dir))  # the same, in one call, from the run's own config
    assert type(loaded) is type(model)
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize(
    "override,key",
    [
        ("sync.period=0", "sync.period"),
        ("sync.warmup_steps=-1", "sync.warmup_steps"),
        ("optim.lr=0", "optim.lr"),
        ("optim.lr=abc", "optim.lr"),
        ("dist.world_size=0", "dist.world_size"),
        ("data=imagenet", "data"),
        ("model=vit", "model"),
        ("+experiment=nope", "experiment"),
        ("data.partition=random", "data.partition"),
        ("optim=lion", "optim"),
        ("optim._target_=torch.optim.Lion", "optim._target_"),
        ("optim.momentm=0.5", "optim.momentm"),
        ("lr_schedule.warmup_steps=-1", "lr_schedule.warmup_steps"),
        ("sync=nope", "sync"),
        ("logger.wandb.mode=cloud", "logger.wandb.mode"),
        ("trainer.precision=16", "trainer.precision"),
        ("trainer.precision=fp8-mixed", "trainer.precision"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val"),
        ("trainer.compile=maybe", "trainer.compile"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_values_are_refused_in_one_line_before_workers_start(tmp_path, capsys, override, key):
    run_dir = tmp_path / "run"
    assert refusal([override, f"hydra.run.dir={run_dir}"], capsys).startswith(f"error: {key} ")
    assert not run_dir.exists()


@pytest.mark.timeout(60)
def test_finished_run_directory_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "summary.json").write_text('{"test_accuracy": 0.5}')
    assert "hydra.run.dir" in refusal(FAST + [f"hydra.run.dir={tmp_path}"], capsys)
    assert (tmp_path / "summary.json").read_text() == '{"test_accuracy": 0.5}'

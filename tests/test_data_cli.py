"""The CIFAR-10 (ResNet-20) and text (transformer) configs through the CLI, on tiny local files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.helpers import FAST, fake_cifar, refusal, run_cli

BASE = [a for a in FAST if not a.startswith(("data", "model"))] + [
    "dist.world_size=2",
    "trainer.batch_size=4",
    "trainer.log_every=2",
]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cifar10_resnet20_averages_batchnorm_statistics_too(tmp_path):
    fake_cifar(tmp_path, per_batch=16)
    run_dir = tmp_path / "run"
    steps, period = 6, 2
    proc = run_cli(
        BASE
        + ["data=cifar10", f"data.root={tmp_path}", "model=resnet20"]
        + [f"trainer.max_steps={steps}", f"sync.period={period}", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "cifar10" and summary["model"] == "resnet20"
    state = torch.load(run_dir / "model.pt", weights_only=True)
    stats = sum(v.numel() for k, v in state.items() if k.endswith(("running_mean", "running_var")))
    assert stats > 0
    # averages after s = 0, 2, 4 and a final one (step 5 was local): parameters and BN statistics
    assert summary["comm_rounds"] == 4
    assert summary["comm_bytes"] == 4 * (summary["params"] + stats) * summary["comm_rounds"]


@pytest.mark.timeout(60)
def test_cifar10_without_a_root_says_how_to_get_it(tmp_path, capsys):
    line = refusal(["data=cifar10", "model=resnet20", f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert line.startswith("error: data.root ") and "cs.toronto.edu" in line


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shakespeare_preset_learns_characters_and_reports_perplexity_and_a_sample(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    run_dir = tmp_path / "run"
    proc = run_cli(
        BASE
        + ["data=shakespeare", f"data.path={text}", "data.seq_len=32", "model=transformer"]
        + ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "optim.lr=0.05"]
        + ["trainer.max_steps=60", "sync.period=4", "trainer.eval_every=20"]
        + ["trainer.eval_samples=5", "trainer.sample_chars=50", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "shakespeare" and summary["model"] == "transformer"
    # 29 distinct characters: chance is ~3.4%; a repeated sentence is learnt quickly
    assert summary["test_accuracy"] > 0.3
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    assert len(summary["sample"]) == 50 and set(summary["sample"]) <= set(text.read_text())
    assert "sample:" in proc.stdout and "test_perplexity=" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]  # periodic: the validation span
    # periodic evaluations carry the communication counters of their moment (for loss vs bytes)
    assert len(evals) >= 3 and all("comm_bytes" in r for r in evals[:-1])
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in evals)
    assert [r for r in records if "test_loss" in r] == records[-1:]  # the test set: at the end


@pytest.mark.timeout(60)
def test_shakespeare_without_the_corpus_names_the_command_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALSGD_DATA_DIR", str(tmp_path / "empty"))
    args = ["data=shakespeare", "model=transformer", f"hydra.run.dir={tmp_path / 'run'}"]
    line = refusal(args, capsys)
    assert "data=shakespeare" in line and "make data" in line
    assert "localsgd.data.prepare shakespeare" in line


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_image_folder_preset_trains_on_a_folder_of_pngs(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("test", 2)):
        for cls in ("cat", "dog", "fox"):
            (tmp_path / "pets" / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "pets" / split / cls / f"{i}.png")
    run_dir = tmp_path / "run"
    proc = run_cli(
        BASE
        + ["data=image_folder", f"data.root={tmp_path / 'pets'}", "data.image_size=16"]
        + ["data.num_workers=1", "model=cnn", "model.channels=[8]", "model.kernel_size=3"]
        + ["trainer.max_steps=4", "sync.period=2", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "image_folder" and summary["steps"] == 4
    state = torch.load(run_dir / "model.pt", weights_only=True)
    weights = [v for k, v in state.items() if k.endswith("weight")]
    assert weights[0].dim() == 4 and weights[0].shape[1] == 3  # 2-D convs over RGB images
    assert weights[-1].shape[0] == 3  # one logit per class folder: cat, dog, fox

"""`localsgd.load(run_dir)`: the model built from the run's own config and loaded with its final
weights, or the best ones `trainer.keep_best` kept by the validation metric."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import localsgd
from localsgd.config import ConfigError, typed
from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import BASE, CONF, SMALL, refusal

pytestmark = pytest.mark.timeout(60)

JOB = SMALL + [
    "trainer.max_steps=30",
    "trainer.eval_every=5",
    "sync.period=5",
    "trainer.keep_best=true",
    "logger.wandb.mode=disabled",
    "logger.plots=false",
    "dist.world_size=1",
]


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _finished_run(run_dir) -> dict:
    """A run trained in-process, its .hydra/config.yaml written as Hydra writes it."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=JOB)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    trainer = Trainer(typed(cfg), WorkerInfo(0, 1, 0, 1), torch.device("cpu"), str(run_dir))
    return trainer.train()


def _same(model: torch.nn.Module, state: dict) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_load_builds_the_runs_model_with_its_final_and_its_best_weights(lone_group, tmp_path):
    summary = _finished_run(tmp_path)
    model = localsgd.load(str(tmp_path))
    assert _same(model, torch.load(tmp_path / "model.pt", weights_only=True))
    assert not model.training
    best = localsgd.load(str(tmp_path), best=True)
    assert _same(best, torch.load(tmp_path / "best.pt", weights_only=True))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluations = [(r["val_accuracy"], -r["step"]) for r in records if "val_accuracy" in r]
    value, step = max(evaluations)  # the first of the best: a tie keeps the earlier weights
    assert summary["best"] == {
        "step": -step, "metric": "val_accuracy", "value": value, "file": "best.pt"
    }  # fmt: skip
    assert len({v for v, _ in evaluations}) > 1  # so that "best" chose among evaluations


def test_load_of_a_run_without_weights_says_why(tmp_path):
    with pytest.raises(ConfigError, match="is no run directory"):
        localsgd.load(str(tmp_path))
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(ConfigError, match="has no model.pt: the run has not finished"):
        localsgd.load(str(tmp_path))


@pytest.mark.parametrize(
    "override,message",
    [
        ("optimized_metric=test_accuracy", "must be a val_* key"),
        ("data.val_fraction=0", "needs the validation split"),
    ],
)
def test_keep_best_without_a_validation_metric_is_refused(override, message, capsys):
    line = refusal(BASE + ["trainer.keep_best=true", override], capsys)
    assert line.startswith("error: trainer.keep_best") and message in line

"""experiments/custom: a user's own model and dataset, added with `--config-dir`, run by the CLI
from the user's folder with no change to localsgd."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CUSTOM = os.path.join(ROOT, "experiments", "custom")
SHORT = [
    "trainer.max_steps=120",
    "sync.warmup_steps=20",  # post_local_sgd's 300 would be the whole run
    "trainer.batch_size=16",
    "trainer.progress=false",
    "dist.world_size=2",
    "dist.timeout_s=60",
    "logger.wandb.mode=disabled",
]


def run_from(cwd: str, args: list[str], env_extra: dict | None = None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "localsgd.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_user_model_and_data_from_their_own_folder_train_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--config-dir", "conf", "model=mynet", "data=mydata", "+experiment=post_local_sgd"]
    proc = run_from(CUSTOM, args + SHORT + ["data.num_workers=1", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["model"] == "Net" and summary["dataset"] == "make_spirals"
    assert summary["warmup_steps"] == 20 and summary["steps"] == 120
    assert summary["test_accuracy"] > 0.6  # 3 spiral arms: chance is 1/3


@pytest.mark.timeout(60)
def test_user_module_off_the_path_is_refused_in_one_line(tmp_path):
    # run from the repository root: mynet is not importable there (and PYTHONPATH is unset)
    conf = os.path.join(CUSTOM, "conf")
    proc = run_from(ROOT, ["--config-dir", conf, "model=mynet", "data=mydata", *SHORT])
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: data._target_ must be an importable callable, got ")
    assert "PYTHONPATH" in line


@pytest.mark.timeout(60)
def test_pythonpath_makes_the_user_module_importable_from_anywhere(tmp_path):
    conf = os.path.join(CUSTOM, "conf")
    args = ["--config-dir", conf, "model=mynet", "data=mydata", *SHORT]
    # a batch larger than a shard: refused only after data and model were imported and built
    proc = run_from(ROOT, args + ["trainer.batch_size=5000"], {"PYTHONPATH": CUSTOM})
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: trainer.batch_size must be <= the smallest worker's shard")


@pytest.mark.timeout(60)
def test_a_model_that_does_not_match_num_classes_is_refused_in_one_line(tmp_path):
    # the node's own num_classes wins over the data's: Net then outputs 5 logits for 3 classes
    args = ["--config-dir", "conf", "model=mynet", "data=mydata", "+model.num_classes=5"]
    proc = run_from(CUSTOM, args + SHORT + [f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: model._target_ 'mynet.Net' must return logits of shape (2, 3)")
    assert "got (2, 5)" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()

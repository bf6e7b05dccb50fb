"""experiments/custom: a user's own model and dataset, added with `--config-dir`, run by the CLI
from the user's folder with no change to localsgd."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import ROOT, refusal, run_cli

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
    """The CLI from `cwd` as a user runs it there: without the test runner's PYTHONPATH."""
    env = {"PYTHONPATH": None, **(env_extra or {})}
    return run_cli(args, timeout=150, env=env, cwd=cwd, fresh=True)  # `-m` puts cwd on the path


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


@pytest.fixture
def user_folder(monkeypatch):
    """In-process stand-in for running from a user's folder: `as_cwd(folder, importable)`
    changes directory and, like `python -m` from there or PYTHONPATH, puts the folder's modules
    on the path (or not). Their earlier imports are forgotten, so each test starts clean."""

    def as_cwd(folder: str, importable: str | None) -> None:
        for name in ("mynet", "mydata"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.chdir(folder)
        if importable:
            monkeypatch.syspath_prepend(importable)

    return as_cwd


@pytest.mark.timeout(60)
def test_user_module_off_the_path_is_refused_in_one_line(user_folder, capsys):
    # from the repository root: mynet is not importable there (and PYTHONPATH is unset)
    user_folder(ROOT, None)
    conf = os.path.join(CUSTOM, "conf")
    line = refusal(["--config-dir", conf, "model=mynet", "data=mydata", *SHORT], capsys)
    assert line.startswith("error: data._target_ must be an importable callable, got ")
    assert "PYTHONPATH" in line


@pytest.mark.timeout(60)
def test_pythonpath_makes_the_user_module_importable_from_anywhere(user_folder, capsys):
    user_folder(ROOT, CUSTOM)  # PYTHONPATH=experiments/custom
    conf = os.path.join(CUSTOM, "conf")
    args = ["--config-dir", conf, "model=mynet", "data=mydata", *SHORT]
    # a batch larger than a shard: refused only after data and model were imported and built
    line = refusal(args + ["trainer.batch_size=5000"], capsys)
    assert line.startswith("error: trainer.batch_size must be <= the smallest worker's shard")


@pytest.mark.timeout(60)
def test_a_model_that_does_not_match_num_classes_is_refused_in_one_line(
    tmp_path, user_folder, capsys
):
    user_folder(CUSTOM, CUSTOM)  # `python -m` from the folder imports its modules
    # the node's own num_classes wins over the data's: Net then outputs 5 logits for 3 classes
    args = ["--config-dir", "conf", "model=mynet", "data=mydata", "+model.num_classes=5"]
    line = refusal(args + SHORT + [f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert line.startswith("error: model._target_ 'mynet.Net' must return logits of shape (2, 3)")
    assert "got (2, 5)" in line
    assert not (tmp_path / "run").exists()

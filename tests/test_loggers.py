"""A real offline wandb run, read back from its `.wandb` file: history, group, job type, name."""

from __future__ import annotations

import glob
import json
import os
import shlex

import pytest

from tests.test_cli import FAST, run_cli
from tests.wandb_reader import history, run_info

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_offline_wandb_run_holds_the_metrics_and_names_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    args = [a for a in FAST if not a.startswith("logger.")]
    proc = run_cli(
        ["-m", *args]
        + [
            "logger.wandb.mode=offline",
            "logger.wandb.tags=[test]",
            "dist.world_size=2",
            "trainer.max_steps=40",
            "trainer.log_every=10",
            "trainer.eval_every=20",
            "sync=diloco",  # job_type names the strategy, not just "local_sgd"
            "sync.period=4",
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=job",  # the override-named folder would pass 255 characters
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = [p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")]
    (log,) = glob.glob(glob.escape(str(job / "wandb")) + "/offline-run-*/run-*.wandb")
    (hint,) = [line for line in proc.stdout.splitlines() if "wandb sync" in line]
    assert shlex.split(hint.split("`")[1]) == ["wandb", "sync", os.path.dirname(log)]

    rows = history(log)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    for row in train:
        assert {"lr", "comm_rounds", "comm_bytes", "comm_seconds", "samples"} <= row.keys()
        assert {"samples_per_s", "comm_share", "drift"} <= row.keys()
        assert row["drift"] > 0  # the replicas did move apart between averages
    assert rows[-1]["test_accuracy"] > 0.3  # the final evaluation shares the last step's row
    # the wandb history and metrics.jsonl hold the same numbers
    jsonl = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["comm_bytes"] for r in jsonl if "loss" in r] == [r["comm_bytes"] for r in train]

    run = run_info(log)
    assert run.run_group == str(sweep)  # the sweep is one group on the dashboard
    assert run.job_type == "diloco"
    assert "sync=diloco" in run.display_name and "sync.period=4" in run.display_name
    assert list(run.tags) == ["test"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["sync"]["period"] == 4 and config["logger"]["wandb"]["mode"] == "offline"

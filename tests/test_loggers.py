"""A real offline wandb run, read back from its `.wandb` file: history, group, job type, name."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex

import pytest

from localsgd.config import WandbConfig
from localsgd.loop.loggers import resolve_wandb_settings
from tests.helpers import BASE, FAST, cli, run_cli
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


@pytest.mark.timeout(240)
def test_a_resumed_run_continues_the_same_wandb_run_with_every_step_once(tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in BASE if not a.startswith("logger.")]
    args += ["logger.wandb.mode=offline", "trainer.checkpoint_every=8", f"hydra.run.dir={run_dir}"]
    # rank 0 dies by SIGKILL right after the checkpoint (and the log line) at step 8
    killed, left = cli(args, fault=f"kill:0:8:{tmp_path / 'once'}")
    assert killed.returncode != 0 and not left
    assert (run_dir / "checkpoints" / "step-8").is_dir()
    resumed, left = cli(args, fault=f"kill:0:8:{tmp_path / 'once'}")
    assert resumed.returncode == 0 and not left, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stderr

    logs = sorted(glob.glob(glob.escape(str(run_dir / "wandb")) + "/offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # one offline file per launch, both of the same run
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    ids = set()
    for log in logs:  # the killed launch's file may hold nothing: wandb had not flushed it
        with contextlib.suppress(AssertionError):
            ids.add(run_info(log).run_id)
    assert ids == {run_id}
    resumed_log = max(logs, key=os.path.getmtime)
    steps = [r["step"] for r in history(resumed_log) if "loss" in r]
    assert steps == [4, 8, 12, 16, 20, 24]  # one continuous curve, each step once


def test_wandb_environment_decides_where_the_config_leaves_a_key_unset():
    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "theirs", "WANDB_DIR": "/tmp/w"}
    unset = WandbConfig()
    resolve_wandb_settings(unset, env)
    assert (unset.mode, unset.project, unset.entity, unset.dir) == (
        "disabled",
        "theirs",
        None,
        "/tmp/w",
    )
    explicit = WandbConfig(mode="offline", project="mine")
    resolve_wandb_settings(explicit, env)
    assert explicit.mode == "offline" and explicit.project == "mine"  # the config wins
    defaults = WandbConfig()
    resolve_wandb_settings(defaults, {})
    assert defaults.mode == "offline" and defaults.project == "localsgd"
    with pytest.raises(ValueError, match="^WANDB_MODE must be one of offline, online, disabled,"):
        resolve_wandb_settings(WandbConfig(), {"WANDB_MODE": "cloud"})


@pytest.mark.timeout(120)
def test_wandb_mode_disabled_in_the_environment_keeps_a_run_off_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    args = [a for a in FAST if not a.startswith("logger.")]
    proc = run_cli(args + ["dist.world_size=2", "trainer.max_steps=8", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (run_dir / "wandb").exists() and "wandb sync" not in proc.stdout

"""Failures end the whole job quickly, name the rank, and leave no worker behind; NaN losses and
diverged replicas are caught; torchrun runs (two "nodes", an elastic restart) behave the same."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from localsgd.loop import checkpoint
from tests.helpers import (
    BASE,
    ROOT,
    TORCHRUN,
    cli,
    free_port,
    run,
    same_model,
    survivors,
    tagged_env,
)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_nan_loss_stops_the_run_naming_step_and_rank_and_keeps_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc, left = cli(BASE + [f"hydra.run.dir={run_dir}"], fault="nan:1:8")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "worker rank 1 failed" in proc.stderr
    assert "non-finite loss at step 8 on rank 1" in proc.stderr, proc.stderr[-2000:]
    # one line on the terminal, the worker's whole traceback in the run's log
    assert f"(its traceback: {run_dir / 'train.log'})" in proc.stderr, proc.stderr[-2000:]
    log = (run_dir / "train.log").read_text()
    assert "worker rank 1 failed:\nTraceback (most recent call last):" in log, log[-2000:]
    assert time.monotonic() - started < 90  # well within dist.timeout_s of the failure
    assert not left, "a worker outlived the failed job"
    # the checkpoint due at step 10 was refused (it would hold NaN); step 5's is intact
    assert checkpoint.newest_complete(str(run_dir), 2) == checkpoint.step_dir(str(run_dir), 5)


@pytest.mark.timeout(120)
def test_nan_policy_skip_skips_the_step_and_replicas_stay_identical(tmp_path):
    run_dir = tmp_path / "run"
    # step 3 is in the synchronous warmup: the skipping rank must still step with the averaged
    # gradients, which sync.check_replicas verifies after every sync.
    proc, _ = cli(
        BASE + [f"hydra.run.dir={run_dir}", "trainer.nan_policy=skip", "sync.check_replicas=true"],
        fault="nan:0:3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps"] == 24


@pytest.mark.timeout(120)
def test_check_replicas_fails_loudly_when_replicas_differ(tmp_path):
    proc, left = cli(
        BASE + [f"hydra.run.dir={tmp_path / 'run'}", "sync.check_replicas=true"],
        fault="desync:1:11",  # step 11 is an average; rank 1's parameters move after it
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "replicas differ after the sync at step 11: rank(s) [1]" in proc.stderr
    assert not left


def _torchrun(nodes: int, port: int, extra: list[str]) -> list[str]:
    return [
        TORCHRUN,
        f"--nnodes={nodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=localsgd-test",
        "--rdzv-conf=join_timeout=60,read_timeout=60",
        "--monitor-interval=0.2",
        *extra,
        "-m",
        "localsgd.train",
    ]


@pytest.mark.long  # ~32 s on 2 cores: `make test-long` (one-node torchrun stays in `make test`)
@pytest.mark.timeout(240)
def test_torchrun_two_nodes_train_into_one_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    # the narrow hierarchical level defaults to the node: pairs here, torchrun's LOCAL_WORLD_SIZE
    levels = "sync.levels=[{group_size:node,period:2},{group_size:world,period:4}]"
    # a checkpoint at step 21, after a global sync (torch's rule: step index 20, 20 % 4 == 0)
    base = [a for a in BASE if not a.startswith("trainer.checkpoint_every")]
    args = base + [
        "trainer.checkpoint_every=7",
        f"hydra.run.dir={run_dir}",
        "dist.world_size=null",
        levels,
    ]
    env, tag = tagged_env()
    nodes = [
        subprocess.Popen(
            _torchrun(2, port, []) + args,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=200)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 24
    assert [lv["group_size"] for lv in summary["comm_levels"]] == [2, 4]
    assert checkpoint.newest_complete(str(run_dir), 4) == checkpoint.step_dir(str(run_dir), 24)
    # the same run continues under torchrun at another world size: 4 -> 2 (one node)
    at_sync = checkpoint.step_dir(str(run_dir), 21)
    more = tmp_path / "more"
    proc = subprocess.run(
        _torchrun(1, free_port(), [])
        + [a for a in args if not a.startswith("hydra.run.dir")]
        + [f"hydra.run.dir={more}", f"trainer.resume={at_sync}", "trainer.max_steps=32"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "resuming at another world size: 4 workers' averaged model" in proc.stderr
    summary = json.loads((more / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 32
    assert not survivors(tag)


@pytest.mark.long  # ~18 s on 2 cores with its reference run: `make test-long`
@pytest.mark.timeout(240)
def test_torchrun_restart_resumes_and_matches_an_uninterrupted_run(tmp_path, reference_run):
    run_dir = tmp_path / "run"
    proc, left = run(
        _torchrun(1, free_port(), ["--max-restarts=1"]) + BASE + [f"hydra.run.dir={run_dir}"],
        fault=f"kill:1:13:{tmp_path / 'fired'}",  # once: the restarted worker does not die again
        timeout=200,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "resuming from" in proc.stderr and "step-10" in proc.stderr
    assert same_model(run_dir / "model.pt", reference_run / "model.pt")
    assert not left


@pytest.mark.timeout(180)
# the kill (~10 s) in `make test-long`: a raise already shows torchrun ending the job on a rank
@pytest.mark.parametrize("kind", ["raise", pytest.param("kill", marks=pytest.mark.long)])
def test_torchrun_worker_failure_ends_the_job_naming_the_rank(tmp_path, kind):
    started = time.monotonic()
    proc, left = run(
        _torchrun(1, free_port(), ["--max-restarts=0"])
        + BASE
        + [f"hydra.run.dir={tmp_path / 'run'}"],
        fault=f"{kind}:1:9",
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert time.monotonic() - started < 120
    if kind == "raise":
        assert "worker rank 1 failed: RuntimeError: injected fault at step 9" in out, out[-3000:]
    else:
        assert "rank      : 1" in out and "Signal 9" in out, out[-3000:]
    assert not left


@pytest.mark.long  # ~9 s: SIGTERM to every worker is `make test`'s (tests/test_interrupt.py)
@pytest.mark.timeout(180)
def test_torchrun_forwards_sigterm_and_the_workers_checkpoint_at_an_agreed_step(tmp_path):
    run_dir = tmp_path / "run"
    proc, left = run(
        _torchrun(1, free_port(), []) + BASE + [f"hydra.run.dir={run_dir}"],
        fault="sigterm:1:8",  # to torchrun's agent, which sends SIGTERM to both workers
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    # torchrun re-raises the signal itself (exit 1); the workers stopped cleanly and saved.
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", out)
    assert stopped and int(stopped[1]) in (12, 17, 22), out[-3000:]
    assert "Traceback" not in out.split("SIGTERM: stopped")[0]
    folder = checkpoint.step_dir(str(run_dir), int(stopped[1]))
    checkpoint.verify(folder, world_size=2)
    assert not (run_dir / "summary.json").exists() and not left

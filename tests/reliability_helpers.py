"""Shared pieces of the reliability tests: the CLI in a subprocess, tagged so that a test can
prove no worker outlived its job, and exact comparison of saved models."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import pytest
import torch

from tests.conftest import ROOT

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

# 24 steps, 2 workers; warmup steps 0-5 communicate, then averages after steps 6, 11, 16, 21.
# Checkpoints every 5 steps: the one at step 5 falls in the warmup, the one at 10 between syncs
# (step 9 was local, so the two replicas differ there).
BASE = [
    "data=synthetic",
    "data.num_samples=600",
    "model=mlp",
    "model.hidden=[16]",
    "model.dropout=0.1",  # so the per-rank RNG state matters for an exact resume
    "trainer.batch_size=8",
    "trainer.max_steps=24",
    "trainer.checkpoint_every=5",
    "trainer.log_every=4",
    "trainer.eval_every=8",
    "trainer.progress=false",
    "sync.warmup_steps=6",
    "sync.period=5",
    "dist.world_size=2",
    "dist.timeout_s=30",
]


def tagged_env(fault: str | None = None) -> tuple[dict, str]:
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOCALSGD_TEST_TAG": tag, "OMP_NUM_THREADS": "1"}
    env.pop("LOCALSGD_FAULT", None)
    if fault:
        env["LOCALSGD_FAULT"] = fault
    return env, tag


def run(cmd: list[str], fault: str | None = None, timeout: float = 120):
    """Run `cmd` from the repository root; returns (CompletedProcess, processes left behind)."""
    env, tag = tagged_env(fault)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, survivors(tag)


def cli(args: list[str], fault: str | None = None, timeout: float = 120):
    return run([sys.executable, "-m", "localsgd.train", *args], fault, timeout)


def survivors(tag: str) -> list[int]:
    """PIDs of live processes started with this tag in their environment."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"LOCALSGD_TEST_TAG={tag}".encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(") ")[-1][0] != "Z":
                            found.append(int(pid))
        except OSError:
            continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_model(a, b) -> bool:
    sa = torch.load(a, weights_only=True)
    sb = torch.load(b, weights_only=True)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def train_records(run_dir) -> list[dict]:
    """metrics.jsonl without the fields that measure time."""
    import json

    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.append({k: v for k, v in record.items() if k not in ("wall_time_s", "comm_seconds")})
    return out


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """BASE trained without interruption: what every interrupted variant must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc, left = cli(BASE + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    return run_dir

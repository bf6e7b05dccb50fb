"""`make gpu-check` (experiments/gpu_check/gpu_check.py): refuses in one line without CUDA, and
its checks pass on CPU/gloo with `--cpu`, so the script itself is known to run where no GPU is
lent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "experiments", "gpu_check", "gpu_check.py")


def _run(*args: str, timeout: float, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.timeout(60)
def test_without_cuda_it_says_so_in_one_line_and_fails(capsys):
    from experiments.gpu_check.gpu_check import main

    assert main([]) == 2  # the script's exit code
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "no CUDA device here" in line


@pytest.mark.long  # ~25 s: the whole GPU check at CPU size (the GPU's own run is make gpu-check)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checks_pass_on_cpu_one_line_each():
    proc = _run("--cpu", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "gpu-check: all passed"
    status = {line.split(":")[0] for line in lines[:-1]}
    assert status == {
        "PASS device pick",
        "PASS gloo ReduceOp.AVG",
        "PASS bf16-mixed",
        "PASS 16-mixed",
        "SKIP pinned-memory loading",
        "SKIP CUDA RNG in checkpoints",
        "PASS exact resume",
        "SKIP ft=torchft",
        "SKIP sharded DiLoCo",
        "SKIP outer state in host memory",
        "PASS make train on dist.device=cpu",
    }


def test_a_failing_check_is_one_fail_line_and_the_rest_still_run(capsys):
    from experiments.gpu_check.gpu_check import Checks, Skip

    checks = Checks()
    checks.run("broken", lambda: 1 / 0)
    checks.run("fine", lambda: "ok")

    def skipped():
        raise Skip("no CUDA RNG on CPU")

    checks.run("cuda only", skipped)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "FAIL broken: ZeroDivisionError: division by zero"
    assert lines[1].startswith("PASS fine: ok (")
    assert lines[2] == "SKIP cuda only: no CUDA RNG on CPU"
    assert checks.failed == 1  # main() exits 1 when this is not 0


@pytest.mark.slow
@pytest.mark.long  # ~5 s, beside the whole check at CPU size (above): `make test-long`
@pytest.mark.timeout(120)
def test_a_check_past_the_budget_fails_the_whole_run_and_leaves_no_process():
    from tests.helpers import survivors, tagged_env

    env, tag = tagged_env()
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--cpu"],
        cwd=ROOT,
        env={**env, "GPU_CHECK_BUDGET_S": "3"},
        capture_output=True,  # returns only once no process holds the pipes any more
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1] == "FAIL gpu-check: not done within 3 s"
    assert not survivors(tag)

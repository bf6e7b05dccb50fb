"""The runnable examples in examples/ run as written and check what they claim."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import ROOT, run


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_averaging_without_hydra_runs_and_its_replicas_meet_at_each_average():
    """docs/averaging-api.md's complete script: 2 spawned gloo workers, torch's call
    `average_parameters` after each step; the script itself asserts the replicas are identical
    right after each average and apart between averages."""
    script = os.path.join(ROOT, "examples", "averaging_without_hydra.py")
    proc, left = run([sys.executable, script], timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    assert proc.stdout.count("averaged: replicas identical") == 4  # steps 0, 4, 8, 12
    assert proc.stdout.strip().endswith("2 workers, 13 steps, an average every 4: ok")

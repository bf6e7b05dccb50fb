"""Replica drift: the mean L2 distance of the replicas to their average, measured at averages."""

from __future__ import annotations

import pytest
import torch

from localsgd.averaging import PeriodicAverager
from localsgd.loop.drift import DriftMeter
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow


def _drift_worker(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    averager = PeriodicAverager(1, module=model)
    meter = DriftMeter(averager.flat.buffers)
    averager.global_hooks.append(meter)  # as the trainer's synchroniser attaches it
    scratch_ptrs = [s.data_ptr() for s in meter.scratch]
    # Replica r = the shared start + r * 1.5 * e (a unit vector): distances to the average differ
    # per rank, so the mean distance and the root-mean-square distance disagree.
    flat = averager.flat.buffers[0]
    direction = torch.zeros_like(flat)
    direction[3] = 1.0
    drifts = []
    for _ in range(2):
        with torch.no_grad():
            flat.add_(direction * 1.5 * rank)
        averager.maybe_average()
        drifts.append(meter.take())
    return {
        "drifts": drifts,
        "same_scratch": scratch_ptrs == [s.data_ptr() for s in meter.scratch],
        "empty_take": meter.take(),
    }


@pytest.mark.timeout(90)
def test_drift_is_mean_distance_to_the_average_with_a_reused_scratch():
    world = 3
    results = run_distributed(_drift_worker, world)
    offsets = [1.5 * r for r in range(world)]
    mean = sum(offsets) / world
    expected = sum(abs(o - mean) for o in offsets) / world  # 1.0; RMS would be 1.22
    for r in results:
        assert r["drifts"] == pytest.approx([expected, expected], rel=1e-5)
        assert r["same_scratch"]  # no allocation per average
        assert r["empty_take"] is None  # nothing since the last take

"""Replica drift: the mean L2 distance of the replicas to their average, measured at averages."""

from __future__ import annotations

import pytest
import torch

from localsgd.averaging import PeriodicAverager
from localsgd.loop.drift import DriftMeter, RoundDriftMeter
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


def _unblocked_worker(rank, world_size, flag):
    """Rank 0 measures an average's drift and says so through a file; rank 1 measures only
    once it has read that, so a blocking all-reduce in `after()` would never return."""
    import os
    import time

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    averager = PeriodicAverager(1, module=model)
    meter = DriftMeter(averager.flat.buffers)
    meter.before(averager.flat.buffers)
    with torch.no_grad():
        averager.flat.buffers[0].add_(float(rank))
    if rank == 0:
        meter.after(averager.flat.buffers)
        open(flag, "w").close()
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                return "rank 0 never returned from after()"
            time.sleep(0.01)
        meter.after(averager.flat.buffers)
    return meter.take()


@pytest.mark.timeout(60)
def test_measuring_drift_waits_for_no_other_worker_until_it_is_read(tmp_path):
    """A delayed average is merged a step after its launch: a blocking collective there would
    hold every worker until the slowest arrives, a second time each round."""
    results = run_distributed(_unblocked_worker, 2, str(tmp_path / "flag"), timeout_s=50)
    assert results[0] == results[1] and isinstance(results[0], float), results


class _OneOtherReplica:
    """A torchft round's communicator as `RoundDriftMeter` sees it: one other live replica
    group, whose worker is at distance 3 from the average."""

    size = 2

    def sum_(self, value: torch.Tensor) -> bool:
        value += 3.0
        return True


def _round_drift_worker(rank, world_size):
    model = torch.nn.Linear(3, 2)
    averager = PeriodicAverager(1, module=model)
    meter = RoundDriftMeter(averager.flat.buffers, _OneOtherReplica())
    takes = []
    for committed in (True, False, True):
        buffers = averager.flat.buffers
        meter.before(buffers)
        with torch.no_grad():
            buffers[0][0] += 4.0  # this worker's distance from the average: 4
        meter.after(buffers)
        meter.round_ended(committed)
        takes.append(meter.take())
    return takes


@pytest.mark.timeout(60)
def test_under_torchft_a_round_s_drift_counts_only_if_it_commits():
    """Under ft=torchft the distances are summed through the round's communicator and divided
    by its workers: (4 + 3) / 2; a round rolled back adds no figure."""
    assert run_distributed(_round_drift_worker, 1)[0] == pytest.approx([3.5, None, 3.5])

"""Asynchronous exchanges in flight (`sync.overlap=true` or `sync.delay_steps` with
`sync.mode=async`, `localsgd.averaging.asynchronous.in_flight`): a worker trains on while its
exchange with the syncer runs, and takes the answer τ steps later (or later still, where it
comes later), keeping what it trained meanwhile or mixing.

- every worker equally fast: the synchronous delayed rounds' model (`sync.overlap`, a launched
  all-reduce merged one step late), to float rounding (the syncer sums in arrival order, gloo's
  all-reduce in its ring's);
- one worker 3x slower on the modelled clock: threads of one process give the processes' model
  bit for bit, and the landing step is counted (τ = 2 is not τ = 1);
- a worker whose exchanges are cut off (a partition, under `ft=torchft`) trains on through the
  cut, where without a flight it stands still for the cut's length.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import step_times
from tests.helpers import BASE, FAST, cli, killed_and_resumed, same_model
from tests.test_async_rounds import EQUAL_CLOCKS, SAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

SLOW = ["sync.mode=async", "comm.simulate.worker_speed=[1,1,1,3]",
        "comm.simulate.step_s=0.001", "sync.check_replicas=true", "trainer.max_steps=40",
        "trainer.checkpoint_every=20"]  # fmt: skip


def _run(tmp_path, name: str, args: list[str]) -> dict:
    proc, left = cli(args + [f"hydra.run.dir={tmp_path / name}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_equal_clocks_in_flight_are_the_synchronous_overlap_to_rounding(tmp_path):
    # no meeting but the end, which is no round's launch: a meeting is an exchange every worker
    # waits for, and the synchronous rounds launched at their last step take one more outer
    # step at the end (`StreamingAverager.average`), a meeting none
    args = [a for a in SAME if not a.startswith(("trainer.checkpoint_every", "trainer.max_steps"))]
    args += ["trainer.checkpoint_every=1000", "trainer.max_steps=25", "sync.overlap=true"]
    _run(tmp_path, "sync", args)
    summary = _run(tmp_path, "async", args + EQUAL_CLOCKS)
    sync = torch.load(tmp_path / "sync" / "model.pt", weights_only=True)
    held = torch.load(tmp_path / "async" / "model.pt", weights_only=True)
    for key, value in sync.items():
        torch.testing.assert_close(held[key], value, rtol=1e-5, atol=1e-6)
    assert not same_model(tmp_path / "sync" / "model.pt", tmp_path / "async" / "model.pt")
    # each phase's exchange point-to-point (a sender in flight joins no synchronous round); the
    # end's meeting is one, as without a flight
    assert summary["async_exchanges"] == {"p2p": 6, "collective": 1, "unchanged": 0}
    # one merge of all four at each phase end (after steps 3, 7, ..., 23) and the last step's
    assert summary["async_merges"] == 7 and summary["async_max_staleness"] == 0
    # without the progress merge (the answer replacing the worker's model a step late) it is
    # another model
    args = [a for a in args if a != "sync.overlap=true"] + ["sync.delay_steps=1"]
    _run(tmp_path, "replace", args + EQUAL_CLOCKS)
    assert not same_model(tmp_path / "replace" / "model.pt", tmp_path / "async" / "model.pt")


def test_a_slow_worker_in_flight_is_deterministic_and_lands_tau_steps_late(tmp_path):
    args = FAST + ["dist.world_size=4", "sync.period=4", "sync.outer=diloco"] + SLOW
    runs = {
        "processes": ["sync.overlap=true"],  # τ = 1, keeping the progress
        "threads": ["sync.overlap=true", "dist.virtual_workers=4", "dist.world_size=null"],
        "tau2": ["sync.delay_steps=2", "sync.merge_rule=progress"],
        "replace": ["sync.delay_steps=1"],  # the answer replaces the worker's model
        "mix": ["sync.delay_steps=1", "sync.merge_alpha=0.5"],
        "blocking": [],
    }
    summaries = {name: _run(tmp_path, name, args + extra) for name, extra in runs.items()}
    model = {name: tmp_path / name / "model.pt" for name in runs}
    assert same_model(model["processes"], model["threads"])
    # each key changes the run: τ, the progress kept, the mix, the flight itself
    for one, other in (("processes", "tau2"), ("processes", "replace"), ("replace", "mix"),
                       ("replace", "blocking")):  # fmt: skip
        assert not same_model(model[one], model[other]), (one, other)
    summary = summaries["processes"]
    assert summary["replica_checks"] >= 2  # at the meetings: every worker on one model
    assert summary["async_exchanges"]["collective"] == 0 < summary["async_exchanges"]["p2p"]
    # a sender held for its merge (the grace window) trains on meanwhile: the fleet merges
    # more samples than the blocking one, whose slow sender idles until its merge
    assert summary["async_merged_samples"] > summaries["blocking"]["async_merged_samples"]


def test_a_partitioned_worker_in_flight_trains_through_the_cut(tmp_path):
    """Worker 1's exchanges send nothing for 1.5 s from step 30 on (its process and heartbeats
    run on): in flight its training goes on through the cut, and its last answer lands later;
    without, its training thread waits out the cut (one step lasting the cut's length)."""
    args = FAST + ["dist.world_size=2", "trainer.max_steps=120", "sync.period=8",
                   "sync.outer=diloco", "sync.mode=async", "ft=torchft",
                   "comm.simulate.worker_speed=[1,1]", "comm.simulate.step_s=0.02",
                   "sync.check_replicas=true", "trainer.checkpoint_every=0"]  # fmt: skip
    longest = {}
    for name, extra in (("in_flight", ["sync.overlap=true"]), ("blocking", [])):
        times = tmp_path / f"{name}_times"
        callbacks = (
            "trainer.callbacks=[{_target_:tests.faults.Fault,spec:'partition:1:30:1.5'},"
            f"{{_target_:tests.step_times.StepTimes,path:'{times}'}}]"
        )
        summary = _run(tmp_path, name, args + extra + [callbacks])
        assert summary["replica_checks"] >= 1  # the end's meeting: both on the syncer's model
        # every sample merged: the phases that ended in flight sent theirs once it landed
        assert summary["merged_samples"] == 2 * 120 * 32  # batches of 32 (the default)
        started = step_times.read(str(times), 1)
        assert [s for s, _ in started] == list(range(120))
        longest[name] = max(b - a for (_, a), (_, b) in zip(started, started[1:], strict=False))
    assert longest["blocking"] >= 1.4  # the cut, waited out
    # in flight no step waits for it (steps of 20 ms; a loaded machine stretches them, never
    # to a second)
    assert longest["in_flight"] < 1.0


def test_an_asynchronous_run_in_flight_resumes_exactly_after_a_kill(tmp_path):
    # checkpoints every 5 steps are meetings, where the answer in flight lands first; the
    # kill comes after the one at step 10
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "sync.overlap=true",
                   "comm.simulate.worker_speed=[1,3]", "comm.simulate.step_s=0.002",
                   "sync.check_replicas=true"]  # fmt: skip
    reference, _ = killed_and_resumed(args, tmp_path)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["async_exchanges"]["p2p"] > 0 and summary["replica_checks"] >= 1

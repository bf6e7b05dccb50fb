"""Asynchronous rounds over sharded replica groups (`sync.mode=async` with `dist.shard_size`):
each shard is averaged among the ranks holding it, one per replica group, through a syncer of
its own on the first of them; a replica group is one worker, on its slowest rank's clock.

- every group equally fast with a quorum of all and the synchronous outer step gives the
  synchronous sharded run's model bit for bit (here Streaming DiLoCo's, a fragment a phase);
- with one group 3x slower its shards are merged stale, the replicas end bit-identical, and
  a run killed after a checkpoint resumes to the same model;
- on the wall clock, with phases by time, a group's ranks end each phase together (in
  `make test-long`).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import BASE, FAST, cli, killed_and_resumed, refusal
from tests.test_async_fragments import SAME
from tests.test_async_rounds import same_as_synchronous

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SHARDED = ["dist.shard_size=2"]


def test_equal_clocks_are_the_synchronous_sharded_run_bit_for_bit(tmp_path):
    summary = same_as_synchronous(tmp_path, SAME + SHARDED, workers=2)
    # as unsharded: 5 rounds of each fragment and the meeting's two, every one synchronous
    assert summary["async_exchanges"]["collective"] == 11 and summary["async_merges"] == 12


def test_a_slow_sharded_group_merges_stale_and_resumes_exactly(tmp_path):
    # replica group 1 (ranks 2 and 3; rank 3 is the slow one, so both compute at its pace)
    args = BASE + SHARDED + [
        "dist.world_size=4", "sync.outer=diloco", "sync.mode=async", "sync.period=4",
        "comm.simulate.worker_speed=[1,1,1,3]", "comm.simulate.step_s=0.002",
        "sync.check_replicas=true", "sync.grace_s=0",  # (the adaptive window merges it fresh)
    ]  # fmt: skip
    reference, resumed = killed_and_resumed(args, tmp_path)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["async_exchanges"]["p2p"] > 0  # merges that did not take every group
    assert summary["async_max_staleness"] >= 1
    assert summary["replica_checks"] >= 1  # at the meetings: bit-identical replicas


@pytest.mark.long  # the wall clock: `make test-long`
def test_on_the_wall_clock_a_sharded_group_ends_its_phases_together(tmp_path):
    # DyLU by wall time: each rank measures its own, and a rank that sent while its group's
    # other rank trained on would leave FSDP's collectives waiting; the group follows its
    # first rank's clock
    run_dir = tmp_path / "run"
    args = FAST + SHARDED + [
        "dist.world_size=4", "trainer.max_steps=120", "sync.outer=diloco", "sync.mode=async",
        "sync.inner_time_s=0.04", "sync.grace_s=0.05", "trainer.checkpoint_every=40",
        "sync.check_replicas=true", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_checks"] == 3  # at the meetings: bit-identical replicas
    assert summary["async_exchanges"]["p2p"] > 3  # phases besides the meetings


def test_a_sharded_asynchronous_checkpoint_resumes_at_another_layout(tmp_path, capsys):
    """2 groups of 2 ranks, then 2 unsharded workers (each shard's syncer state put together
    whole), then 1 worker (N, the workers by default, becomes 1: Delayed Nesterov's momentum
    carries into torch's SGD); the syncer goes on from its version each time. With fragments
    the sharded syncers' per-fragment outer states do not move: refused in one line."""
    run_dir = tmp_path / "run"
    args = FAST + ["sync.period=4", "sync.outer=diloco", "sync.mode=async",
                   "trainer.checkpoint_every=10", "sync.check_replicas=true",
                   f"hydra.run.dir={run_dir}"]  # fmt: skip
    versions = []
    for layout, steps in (
        ["dist.world_size=4", "dist.shard_size=2"], 20), (["dist.world_size=2"], 30), (
        ["dist.world_size=1"], 40):  # fmt: skip
        proc, _ = cli(args + layout + [f"trainer.max_steps={steps}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == steps
        versions.append(summary["async_version"])
    assert 0 < versions[0] < versions[1] < versions[2], versions
    fragmented = tmp_path / "fragments"
    proc, _ = cli(args[:-1] + ["sync.fragments=2", "dist.world_size=4", "dist.shard_size=2",
                               "trainer.max_steps=10", f"hydra.run.dir={fragmented}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = refusal(args[:-1] + ["sync.fragments=2", "dist.world_size=2", "trainer.max_steps=20",
                                f"hydra.run.dir={fragmented}"], capsys)  # fmt: skip
    assert "sync.fragments=2" in line and "sharded outer state per fragment" in line, line

"""Hierarchical levels under asynchronous rounds (`sync.levels` with `sync.mode=async`): each
inner level a plain mean of the whole model within groups of workers at the steps its period
divides, every group's workers waiting for each other there, while the widest level is the
asynchronous one (`AsyncAverager._add_inner_levels`).

- every worker equally fast, a quorum of all and the synchronous outer step: the synchronous
  run's model (Streaming DiLoCo's inner levels under DiLoCo's rounds) bit for bit;
- one worker 3x slower under the modelled clock: the run ends (a sender held for its merge
  would block its group's next mean while the merge waits for a worker of that group: a
  deadlock), with its inner levels' rounds counted at their own period, and threads of one
  process give the processes' model bit for bit.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import cli, same_model
from tests.test_async_rounds import SAME, same_as_synchronous

pytestmark = pytest.mark.timeout(120)

LEVELS = "sync.levels=[{group_size:2,period:2},{group_size:world,period:8}]"


def _levels(steps: int) -> list[str]:
    # no meetings but the end (a meeting merges everyone, where the synchronous rounds do not)
    args = [a for a in SAME if not a.startswith(("trainer.checkpoint_every", "trainer.max_steps",
                                                 "sync.period="))]  # fmt: skip
    return args + [f"trainer.max_steps={steps}", "trainer.checkpoint_every=1000", LEVELS]


@pytest.mark.slow
def test_equal_clocks_with_levels_are_synchronous_hierarchical_diloco_bit_for_bit(tmp_path):
    summary = same_as_synchronous(tmp_path, _levels(67))
    assert summary["async_exchanges"] == {"p2p": 0, "collective": 9, "unchanged": 0}
    inner, outer = summary["comm_levels"]
    assert (inner["group_size"], inner["period"], outer["period"]) == (2, 2, 8)
    assert inner["rounds"] == 32  # after steps 4, 6, ..., 66, beside the outer rounds too


@pytest.mark.slow
def test_a_slow_worker_in_a_group_neither_blocks_it_nor_changes_the_replay(tmp_path):
    args = _levels(40) + ["sync.mode=async", "comm.simulate.worker_speed=[1,1,1,3]",
                          "comm.simulate.step_s=0.001", "trainer.checkpoint_every=20",
                          "sync.check_replicas=true", "dist.timeout_s=20"]  # fmt: skip
    runs = {}
    for name, extra in (("processes", []), ("threads", ["dist.virtual_workers=4"])):
        proc, _ = cli(args + extra + [f"hydra.run.dir={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert same_model(tmp_path / "processes" / "model.pt", tmp_path / "threads" / "model.pt")
    summary = runs["processes"]
    assert summary["async_exchanges"]["p2p"] > 0 and summary["replica_checks"] >= 2
    assert summary["comm_levels"][0]["rounds"] == 18  # after steps 4, 6, ..., 38

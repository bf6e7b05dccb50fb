"""Per-worker step counts (`sync.inner_time_s`) through torchft (`ft=torchft`): each round's
weights ride one small all-reduce through the Manager, each replica's contribution is weighted by
the samples it trained on, and with no fault the model is the torch.distributed path's, bit for
bit; a healing replica weighs nothing, and a slow worker killed and restarted heals and trains
on at its own speed."""

from __future__ import annotations

import json

import pytest

from tests.helpers import FAST, FT_JOB, as_torchrun_rank, cli, refusal, same_model

pytest.importorskip("torchft")

# 3 workers, the third three times slower: a budget of 4 steps at speed 1 leaves it 1 step a
# round (3 x 2 ms do not fit in 8 ms after one), the others 4
PACED = FT_JOB + [
    "sync.inner_time_s=0.008",
    "comm.simulate.worker_speed=[1,1,3]",
    "comm.simulate.step_s=0.002",
]
DILOCO_INT4 = ["sync.outer=diloco", "optim=adamw", "optim.lr=0.003", "sync.comm_dtype=int4"]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy",
    [[], pytest.param(DILOCO_INT4, marks=pytest.mark.long)],  # int4 gathered under ft: long
    ids=["post_local_sgd", "diloco_int4"],
)
def test_weighted_rounds_through_torchft_are_the_plain_paths_bit_for_bit(tmp_path, strategy):
    """The paced job through torch.distributed and through torchft's Manager: the same weights
    (the slow worker's 16 samples a round against 48), the same weighted sums (an fp32 all-reduce
    of each replica's share; int4 messages gathered, decoded and scaled by their weights), the
    same model to the last bit. Every sample a worker trained on reached a committed state:
    merged_samples is the weighted rounds' samples plus the warmup's."""
    plain, ft = tmp_path / "plain", tmp_path / "ft"
    for run_dir, extra in ((plain, []), (ft, ["ft=torchft", "sync.check_replicas=true"])):
        proc, left = cli(PACED + strategy + extra + [f"hydra.run.dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not left
    assert same_model(plain / "model.pt", ft / "model.pt")
    got = json.loads((ft / "summary.json").read_text())
    ref = json.loads((plain / "summary.json").read_text())
    assert got["round_weights"] == ref["round_weights"] == [3 * 16, 3 * 16, 16]
    assert got["contributed_samples"] == ref["contributed_samples"]
    assert got["merged_samples"] == got["contributed_samples"] + 4 * 16 * 3
    assert got["participants"] == 3 and got["failed_syncs"] == 0 and got["replica_checks"] > 0


@pytest.mark.slow
@pytest.mark.long  # `make test-long`
@pytest.mark.timeout(180)
def test_a_slow_worker_killed_under_weighted_rounds_heals_and_trains_on_at_its_pace(tmp_path):
    """The slow worker SIGKILLed at step 30: the next rounds weigh the two others, it is
    restarted, heals from a live peer in a round where it weighs nothing (its contribution is
    zeros), and trains on at its own speed: the last round (3 steps) weighs it 16 samples again,
    the others 48. Every sync is checked bit-identical across the replica groups."""
    run_dir = tmp_path / "run"
    proc, left = cli(
        PACED + ["ft=torchft", "sync.check_replicas=true", f"hydra.run.dir={run_dir}"],
        fault=f"kill:2:30:{tmp_path / 'killed-once'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert "ft: worker 2 died (signal 9); restart 1 of 3" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heals"] == 1 and summary["participants"] == 3
    assert summary["round_weights"] == [3 * 16, 3 * 16, 16]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # rounds of 4 steps without the slow worker: the two others weigh 64 samples each, and a
    # member still in the quorum while it heals, nothing
    weights = [r["round_weights"] for r in lines if r.get("participants") == 2]
    assert weights and all(w[:2] == [4 * 16, 4 * 16] and w[2:] in ([], [0]) for w in weights)


@pytest.mark.timeout(30)
def test_weighted_rounds_over_replica_groups_of_several_processes_are_refused(
    tmp_path, capsys, monkeypatch
):
    as_torchrun_rank(monkeypatch)
    args = FAST + [
        "ft=torchft",
        "ft.lighthouse=127.0.0.1:29510",
        "ft.replica_groups=2",
        "ft.replica_id=group_0",
        "sync.inner_time_s=1",
        f"hydra.run.dir={tmp_path}",
    ]
    line = refusal(args, capsys)
    assert "ft=torchft with sync.inner_time_s and replica groups of several processes" in line

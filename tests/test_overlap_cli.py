"""sync.overlap from the command line: rounds, drift, evaluation, exact resume, agreed stop."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import BASE, cli, refusal, same_model

pytestmark = pytest.mark.slow

# BASE: 24 steps, 2 workers, warmup 6. With period 4 the averages launch after steps 6, 10, 14,
# 18, 22 and merge one step later; the checkpoint at 15 steps holds the one launched at 14.
OVERLAP = BASE + ["sync.period=4", "sync.overlap=true", "sync.bucket_mb=0.001"]


@pytest.fixture(scope="module")
def overlap_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("overlap") / "run"
    proc, left = cli(OVERLAP + [f"hydra.run.dir={run_dir}", "sync.check_replicas=true"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left
    return run_dir


@pytest.mark.timeout(180)
def test_overlap_from_the_cli_counts_rounds_and_resumes_bit_identical(tmp_path, overlap_reference):
    summary = json.loads((overlap_reference / "summary.json").read_text())
    # 6 warmup steps + 5 overlapped averages + the blocking final one (step 23 was local)
    assert summary["comm_rounds"] == 6 + 5 + 1
    assert summary["comm_levels"][0]["rounds"] == 5 + 1
    lines = (overlap_reference / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    # drift is measured where an average is merged: every log interval from step 8 holds one
    # (the first merge is after step 8), and the replicas had moved apart by then
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train if r.get("drift", 0) > 0] == [8, 12, 16, 20, 24]
    assert any("val_accuracy" in r for r in records[:-1])  # evaluated after a merge

    run_dir = tmp_path / "run"
    proc, _ = cli(OVERLAP + [f"hydra.run.dir={run_dir}"], fault="kill:0:17")
    assert proc.returncode == 1 and "worker rank 0 died" in proc.stderr, proc.stderr[-2000:]
    proc, _ = cli(OVERLAP + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"resuming from \S*step-15", proc.stderr), proc.stderr[-2000:]
    assert same_model(run_dir / "model.pt", overlap_reference / "model.pt")


@pytest.mark.timeout(180)
def test_overlap_sigterm_stops_where_the_average_is_merged(tmp_path, overlap_reference):
    run_dir = tmp_path / "run"
    proc, left = cli(OVERLAP + [f"hydra.run.dir={run_dir}"], fault="sigterm:1:8")
    assert proc.returncode == 143, proc.stderr[-3000:]
    stopped = re.search(r"SIGTERM: stopped after step (\d+)", proc.stderr)
    # launches after step indices 10, 14, 18, 22 merge one step later: 12, 16 or 20 steps done
    assert stopped and int(stopped[1]) in (12, 16, 20), proc.stderr[-2000:]
    assert not left and not (run_dir / "summary.json").exists()
    proc, _ = cli(OVERLAP + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", overlap_reference / "model.pt")


@pytest.mark.timeout(60)
def test_overlap_is_shorthand_for_delay_steps_1_with_the_progress_merge(
    tmp_path, overlap_reference
):
    general = [a for a in OVERLAP if a != "sync.overlap=true"]
    general += ["sync.delay_steps=1", "sync.merge_rule=progress", "trainer.checkpoint_every=0"]
    proc, left = cli(general + [f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0 and not left, proc.stderr[-3000:]
    assert same_model(tmp_path / "model.pt", overlap_reference / "model.pt")
    ours = json.loads((tmp_path / "summary.json").read_text())
    ref = json.loads((overlap_reference / "summary.json").read_text())
    assert ours["comm_levels"] == ref["comm_levels"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "override, message",
    [
        ("sync.bucket_mb=0", "sync.bucket_mb must be > 0 (MiB), got 0"),
        ("sync.delay_steps=2", "sync.overlap=true with sync.delay_steps > 1 or sync.merge_alpha"),
        ("sync.merge_alpha=0.5", "sync.overlap=true with sync.delay_steps > 1 or sync.merge_alph"),
    ],
)
def test_overlap_bad_combinations_are_one_line_errors(tmp_path, capsys, override, message):
    args = ["sync.overlap=true", override, f"hydra.run.dir={tmp_path}"]
    assert message in refusal(args, capsys)

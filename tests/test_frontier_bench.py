"""The long benchmarks at toy size (`make test-long`): the communication frontier
(experiments/bench/frontier.py) reports every row, and the 4-bit format sends at most 0.14x
fp32's bytes (a real property of the runs, counted by the trainer: payload plus scales); the
sharded benchmark (experiments/bench/sharded.py) runs both layouts; the asynchronous exchange's
(experiments/bench/async_exchange.py) runs every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script: str, *args: str, timeout: float) -> None:
    """experiments/bench/`script` with `args` (one thread a process); it must exit 0."""
    proc = subprocess.run(
        [sys.executable, f"experiments/bench/{script}", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.long  # ~40 s on 2 cores: `make test-long`
@pytest.mark.timeout(120)
def test_frontier_benchmark_runs_at_tiny_size(tmp_path):
    _bench("frontier.py", "--tiny", "--out", str(tmp_path), timeout=110)
    assert (tmp_path / "frontier.png").stat().st_size > 0
    text = (tmp_path / "FRONTIER.md").read_text()
    results = json.loads((tmp_path / "frontier.json").read_text())
    (link,) = results["links"]
    h = results["p"]["period"]
    names = ["DDP", f"DiLoCo H={h}", *(f"streaming P=4 tau={t}" for t in (0, 1, 2)),
             "streaming P=4 tau=1 4-bit"]  # fmt: skip
    assert list(results["rows"][link]) == names
    table = [line for line in text.splitlines() if line.startswith(f"| {link} |")]
    assert [line.split(" | ")[1] for line in table] == names
    assert all("nan" not in line for line in table)
    runs = results["rows"][link]
    fp32, four_bit = runs[f"DiLoCo H={h}"], runs["streaming P=4 tau=1 4-bit"]
    assert fp32["sync_bytes"] and len(four_bit["sync_bytes"]) == 4 * len(fp32["sync_bytes"])
    assert four_bit["comm_bytes"] <= 0.14 * fp32["comm_bytes"]
    # DDP sends the model every step; streaming the same total as DiLoCo, a quarter at a time
    assert len(runs["DDP"]["sync_bytes"]) == results["p"]["steps"]
    for tau in (0, 1, 2):
        streaming = runs[f"streaming P=4 tau={tau}"]
        assert streaming["comm_bytes"] == fp32["comm_bytes"]
        assert len(streaming["sync_bytes"]) == 4 * len(fp32["sync_bytes"])
        assert max(streaming["sync_bytes"]) < max(fp32["sync_bytes"])
    for run in runs.values():  # each row measured against a compute-only run of this invocation
        assert run["compute_wall_s"] in [b["wall_s"] for b in results["baseline"]]
        assert run["util_measured"] > 0 and 0 < run["util_model"] <= 1


@pytest.mark.slow
@pytest.mark.long  # `make test-long`
@pytest.mark.timeout(180)
def test_sharded_benchmark_runs_at_tiny_size(tmp_path):
    """experiments/bench/sharded.py (GPT-2 small, sharded against replicated) at toy size: both
    layouts run and the table shows half the parameters' and moments' bytes per rank at 2 x 2."""
    out = tmp_path / "SHARDED.md"
    _bench("sharded.py", "--tiny", "--out", str(out), timeout=170)
    text = out.read_text()
    assert "| parameters | 0.00 | 0.00 | 0.500 |" in text
    assert "| AdamW moments | 0.00 | 0.00 | 0.500 |" in text
    assert "| ratio cpu / device |" in text  # sync.outer_state=cpu's rounds, side by side


@pytest.mark.slow
@pytest.mark.long  # ~5 s: `make test-long`
@pytest.mark.timeout(120)
def test_async_exchange_benchmark_runs_at_tiny_size(tmp_path):
    """Every mode runs and the asynchronous runs exchange at each phase."""
    out = tmp_path / "async.json"
    _bench("async_exchange.py", "--tiny", "--json", str(out), timeout=110)
    (row,) = json.loads(out.read_text())["table"].values()
    assert set(row["cost_s"]) == {"sync", "async", "async, grace 0"}
    assert sum(row["async_exchanges"].values()) == 3  # after steps 0 and 4, the meeting at 8

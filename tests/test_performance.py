"""The performance machinery: the simulated slow link, switching communication off, and the
benchmark suite at toy size (it must run end to end; no speed is asserted anywhere)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from localsgd.averaging import (
    AdaptivePeriod,
    CommStats,
    Communicator,
    GradientAverager,
    HierarchicalAverager,
    OptimizerStateSync,
    OuterAverager,
    PeriodicAverager,
    SimulatedLink,
)
from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from tests.helpers import ROOT, CollectiveCounter, compose_config, run_distributed


def test_link_time_is_latency_plus_bytes_over_bandwidth():
    link = SimulatedLink(bandwidth_gbps=0.1, latency_ms=10)
    assert link.seconds(1_250_000) == pytest.approx(0.01 + 0.1)  # 10 Mbit at 100 Mbit/s
    assert SimulatedLink(latency_ms=5).seconds(10**9) == pytest.approx(0.005)
    # the library is Hydra-free: its errors name its own arguments, the CLI's checks the keys
    with pytest.raises(ValueError, match=r"^bandwidth_gbps must be > 0"):
        SimulatedLink(bandwidth_gbps=0)
    with pytest.raises(ValueError, match=r"^latency_ms"):
        SimulatedLink(latency_ms=-1)


@pytest.mark.parametrize(
    "override,key",
    [
        ("comm.simulate.bandwidth_gbps=0", "comm.simulate.bandwidth_gbps"),
        ("comm.simulate.latency_ms=-2", "comm.simulate.latency_ms"),
        ("comm.disabled=true", "comm.disabled=true with sync.warmup_steps > 0:"),  # warmup 5
    ],
)
def test_bad_comm_settings_are_refused(override, key):
    cfg = compose_config([override, "sync.warmup_steps=5"])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert str(refused.value).startswith(key if key.endswith(":") else f"{key} must be")


def _simulated_worker(rank, world_size, bandwidth_gbps, latency_ms):
    link = SimulatedLink(bandwidth_gbps, latency_ms)
    flat = torch.full((250_000,), float(rank + 1))  # 1 MB
    real = torch.full((250_000,), float(rank + 1))
    stats = CommStats()
    Communicator().mean_(real)
    start = time.perf_counter()
    Communicator(None, stats, link).mean_(flat)
    simulated_s = time.perf_counter() - start
    model = torch.nn.Linear(100, 100)
    averager = PeriodicAverager(1, module=model, link=link)
    start = time.perf_counter()
    averager.maybe_average()
    averager_s = time.perf_counter() - start
    return {
        "simulated_s": simulated_s,
        "averager_s": averager_s,
        "stats_s": stats.seconds,
        "mean_ok": bool(torch.equal(flat, real)),
        "model_bytes": averager.stats.bytes,
    }


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_simulated_link_makes_each_collective_last_at_least_its_time():
    bandwidth_gbps, latency_ms = 0.05, 50.0
    expected = SimulatedLink(bandwidth_gbps, latency_ms).seconds(1_000_000)  # 0.21 s
    for r in run_distributed(_simulated_worker, 2, bandwidth_gbps, latency_ms):
        assert r["mean_ok"]  # the real collective ran: same mean as without the link
        assert r["simulated_s"] >= expected
        assert r["stats_s"] >= expected  # the counters see the simulated time
        model_time = SimulatedLink(bandwidth_gbps, latency_ms).seconds(r["model_bytes"])
        assert r["averager_s"] >= model_time


LATENCY_S = 0.1


def _strategy(name: str, link: SimulatedLink, world_size: int):
    """(a model, a call that makes one average of this strategy, its collectives are blocking)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    if name == "gradients":  # the post-local SGD warmup's gradient averaging
        grads = GradientAverager(model, link=link)
        model(torch.randn(4, 8)).sum().backward()
        return grads.all_reduce
    if name == "hierarchical":
        averager = HierarchicalAverager({1: 1, 2: world_size}, module=model, link=link)
        averager.step = 2  # the world level
    elif name == "diloco":
        averager = OuterAverager(1, module=model, link=link)
    elif name == "optimizer_state":
        averager = PeriodicAverager(1, module=model, link=link)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()  # momentum buffers now exist, so the hook averages them: a 2nd collective
        averager.hooks.append(OptimizerStateSync(opt, "average"))
    else:
        averager = PeriodicAverager(
            1,
            module=model,
            link=link,
            comm_dtype="bfloat16" if name == "bf16" else "float32",
            overlap=name == "overlap",
            schedule=AdaptivePeriod(1) if name == "adaptive" else None,
        )
    if name == "overlap":  # launched at one step, merged at the next: that is one average
        return lambda: (averager.maybe_average(), averager.maybe_average())
    return averager.maybe_average


STRATEGIES = [
    "periodic",
    "bf16",
    "adaptive",
    "hierarchical",
    "diloco",
    "optimizer_state",
    "overlap",
    "gradients",
]


def _link_worker(rank, world_size):
    link = SimulatedLink(latency_ms=LATENCY_S * 1e3)
    out = {}
    for name in STRATEGIES:
        average = _strategy(name, link, world_size)
        with CollectiveCounter() as counter:
            start = time.perf_counter()
            average()
            elapsed = time.perf_counter() - start
        out[name] = (counter.count, elapsed)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_strategy_communicates_through_the_simulated_link():
    """Each strategy's collectives all go through the one Communicator, so each lasts at least
    the link's latency: the time of one average >= (its number of collectives) x latency (the
    overlap's bucketed all-reduces are one launch, which lasts at least one latency)."""
    for result in run_distributed(_link_worker, 2):
        for name, (collectives, elapsed) in result.items():
            assert collectives >= 1, name
            blocking = 1 if name == "overlap" else collectives
            assert elapsed >= blocking * LATENCY_S, (name, collectives, elapsed)


def _disabled_worker(rank, world_size, cfg):
    with tempfile.TemporaryDirectory() as run_dir:
        info = WorkerInfo(rank, world_size, rank, world_size)
        trainer = Trainer(cfg, info, torch.device("cpu"), run_dir)
        with CollectiveCounter() as counter:
            summary = trainer.train()
        rounds = trainer.comm_stats.rounds
        return {"collectives": counter.count, "rounds": rounds, "summary": summary}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_comm_disabled_runs_no_collective_at_all():
    cfg = compose_config(
        [
            "data=synthetic",
            "data.num_samples=400",
            "model=mlp",
            "model.hidden=[16]",
            "trainer.max_steps=12",
            "trainer.eval_every=4",
            "trainer.progress=false",
            "trainer.checkpoint_every=0",  # each rank has its own tmp dir here
            "sync.period=2",
            "comm.disabled=true",
        ]
    )
    results = run_distributed(_disabled_worker, 2, cfg)
    assert [r["collectives"] for r in results] == [0, 0]
    assert [r["rounds"] for r in results] == [0, 0]
    assert results[0]["summary"]["comm_bytes"] == 0 and results[0]["summary"]["steps"] == 12


@pytest.mark.long  # a benchmark at toy size: `make test-long`
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_benchmark_suite_runs_at_tiny_size(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [sys.executable, "experiments/bench/run.py", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in ("## 1-2. Averaging cost", "## 3. Trainer throughput", "## 4. Framework",
                    "## 5. Worker memory", "## Not measured here"):  # fmt: skip
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 | 9.7k | 52 |")]
    assert len(rows) == 1  # the fp32 averaging table's one tiny row, every method timed
    assert len(rows[0].split("|")) == 2 + 4 + 6 and "n/a" not in rows[0]
    for method in ("gloo-avg", "ours-bf16", "ours-fp16", "torch-hier-world"):
        assert any(line.startswith(f"| {method} |") for line in text.splitlines())
    for variant in ("k=1", "k=4", "k=16", "k=64", "off"):
        assert any(line.startswith(f"| {variant} |") for line in text.splitlines())


@pytest.mark.slow
@pytest.mark.long  # a benchmark at toy size, as the others here
@pytest.mark.timeout(120)
def test_averaging_benchmark_times_both_hierarchical_levels_at_world_4():
    from experiments.bench import averaging

    reps = 1
    (row,) = averaging.run([4], [10_000], reps, timeout_s=100)
    # The workers checked each hierarchical call averages over its intended group (else they
    # raise); per level, ours counted the check, the warm-up, the memory reading and the reps.
    assert row["hier_rounds"] == [reps + 3, reps + 3]
    assert set(row["max"]) == set(averaging.METHODS)
    text = "\n".join(averaging.render([row], reps))
    hier = [line for line in text.splitlines() if line.startswith("| 4 | 9.7k |")]
    assert len(hier) == 3 and not any("n/a" in line for line in hier)

"""Hydra multirun sweeps end to end, and `python -m localsgd.report` on the sweep they make."""

from __future__ import annotations

import csv
import json
import statistics

import pytest
import yaml

from localsgd.analysis.report import main as report_main
from tests.helpers import FAST, cli, run_cli

pytestmark = pytest.mark.slow

# With each run's own plot, which a multirun draws job after job in one process; and a key less
# in the job directories' names, which Optuna's trials would take past 255 characters.
SWEEP = [a for a in FAST if not a.startswith("logger.plots")]
SWEEP += ["dist.world_size=2", "trainer.max_steps=24", "trainer.eval_every=8"]


def _jobs(sweep) -> dict[str, dict]:
    """Each job directory's overrides -> its summary and metrics."""
    jobs = {}
    for job in sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file()):
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        key = (
            ",".join(line[2:] for line in overrides.splitlines() if line.startswith("- seed="))
            + ","
            + ",".join(
                line[2:] for line in overrides.splitlines() if line.startswith("- sync.period=")
            )
        )
        metrics = (job / "metrics.jsonl").read_text().splitlines()
        jobs[key] = {"summary": json.loads((job / "summary.json").read_text()), "metrics": metrics}
    return jobs


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("basic") / "sweep"
    proc = run_cli(["-m", *SWEEP, "sync.period=1,4", "seed=0,1", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep


@pytest.mark.timeout(300)
def test_basic_launcher_sweep_gives_each_job_its_own_run(basic_sweep):
    jobs = _jobs(basic_sweep)
    assert sorted(jobs) == ["seed=0,sync.period=1", "seed=0,sync.period=4",
                            "seed=1,sync.period=1", "seed=1,sync.period=4"]  # fmt: skip
    for key, job in jobs.items():
        period = 1 if key.endswith("period=1") else 4
        assert job["summary"]["period"] == period
        assert job["summary"]["comm_rounds"] == -(-24 // period) + (23 % period != 0)
    for job in (p for p in basic_sweep.iterdir() if (p / "summary.json").is_file()):
        assert (job / "loss_vs_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = sorted(p.name for p in basic_sweep.iterdir() if p.is_dir())  # N_OVERRIDES
    assert len(names) == 4 and not any("," in n for n in names), names  # no commas in a path
    assert "_model.hidden=[64]_model=mlp_seed=1_sync.period=4_" in names[3]
    # the seed changes the run; the period changes the communication
    assert jobs["seed=0,sync.period=4"]["metrics"] != jobs["seed=1,sync.period=4"]["metrics"]


@pytest.mark.timeout(300)
def test_report_tables_and_plots_from_a_real_sweep(basic_sweep, tmp_path, capsys):
    out = tmp_path / "report"
    assert report_main([str(basic_sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| sync.period=1 | 2 |" in printed and "| sync.period=4 | 2 |" in printed

    jobs = _jobs(basic_sweep)
    rows = {r["config"]: r for r in csv.DictReader((out / "report.csv").open())}
    assert sorted(rows) == ["sync.period=1", "sync.period=4"]
    for period in (1, 4):
        acc = [jobs[f"seed={s},sync.period={period}"]["summary"]["test_accuracy"] for s in (0, 1)]
        row = rows[f"sync.period={period}"]
        assert row["seeds"] == "2"
        assert float(row["test_accuracy"]) == pytest.approx(statistics.fmean(acc))
        assert float(row["test_accuracy_std"]) == pytest.approx(statistics.stdev(acc))
        rounds = jobs[f"seed=0,sync.period={period}"]["summary"]["comm_rounds"]
        assert float(row["comm_rounds"]) == rounds
    assert (out / "report.md").read_text().count("\n| sync.period=") == 2
    for name in ("accuracy_vs_step.png", "loss_vs_comm_bytes.png", "accuracy_vs_k.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.timeout(300)
def test_a_run_table_gives_the_same_report_as_the_sweep_directory(basic_sweep, tmp_path, capsys):
    table = tmp_path / "runs.jsonl"
    assert report_main([str(basic_sweep), "--export", str(table)]) == 0
    assert len(table.read_text().splitlines()) == 4  # one line per run
    assert report_main([str(basic_sweep), "--export", str(table)]) == 2  # never overwritten
    assert "must name a new .jsonl file" in capsys.readouterr().err
    from_dir, from_table = tmp_path / "a", tmp_path / "b"
    assert report_main([str(basic_sweep), "--out", str(from_dir)]) == 0
    assert report_main([str(table), "--out", str(from_table)]) == 0
    assert (from_dir / "report.csv").read_text() == (from_table / "report.csv").read_text()
    for name in ("accuracy_vs_step.png", "loss_vs_comm_bytes.png", "accuracy_vs_k.png"):
        assert (from_table / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text('{"run": "x"}\n')
    assert report_main([str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: not a run-table row" in capsys.readouterr().err


def test_report_refuses_a_directory_without_runs(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no finished run" in capsys.readouterr().err


@pytest.mark.long  # ~19 s on 2 cores: `make test-long`
@pytest.mark.timeout(300)
def test_submitit_local_launcher_reproduces_the_basic_launcher_job(basic_sweep, tmp_path):
    """A job in its own fresh process (submitit) equals the same job run after others in one
    process (basic launcher): nothing leaks from one multirun job into the next."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SWEEP,
            "hydra/launcher=local",
            "sync.period=4",
            "seed=1",
            f"hydra.sweep.dir={sweep}",
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = _jobs(sweep).values()
    reference = _jobs(basic_sweep)["seed=1,sync.period=4"]
    strip = ("wall_time_s", "comm_seconds", "compute_seconds", "samples_per_s", "comm_share")
    assert [{k: v for k, v in json.loads(m).items() if k not in strip} for m in job["metrics"]] == [
        {k: v for k, v in json.loads(m).items() if k not in strip} for m in reference["metrics"]
    ]


@pytest.mark.timeout(300)
def test_optuna_search_maximises_the_returned_validation_accuracy(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "+experiment=optuna_lr",
            "hydra.sweeper.n_trials=2",
            *SWEEP,
            f"hydra.sweep.dir={sweep}",
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracies = [
        json.loads((job / "summary.json").read_text())["val_accuracy"]
        for job in sweep.iterdir()
        if (job / "summary.json").is_file()
    ]
    assert len(accuracies) == 2
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(accuracies)
    assert 0.01 <= best["best_params"]["optim.lr"] <= 1.0


@pytest.mark.long  # ~5 s more: the maximising search stays in `make test`
@pytest.mark.timeout(300)
def test_optuna_search_minimises_the_optimized_metric(tmp_path):
    """`optimized_metric` names what each job returns and `direction` which way is better: two
    trials minimising val_loss report the smaller of the two runs' losses as the best."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "+experiment=optuna_lr",
            "hydra.sweeper.n_trials=2",
            "optimized_metric=val_loss",
            "hydra.sweeper.direction=minimize",
            *SWEEP,
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra.job.num}",  # all the overrides make too long a name
        ]  # fmt: skip
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [
        json.loads((job / "summary.json").read_text())["val_loss"]
        for job in sweep.iterdir()
        if (job / "summary.json").is_file()
    ]
    assert len(losses) == 2 and min(losses) < max(losses)  # so that the direction matters
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(losses)


@pytest.mark.timeout(120)
def test_an_optimized_metric_the_summary_lacks_is_one_line_naming_the_keys(tmp_path):
    """Under a sweep, whose sweeper reads it (a single run's objective is read by nobody)."""
    sweep = tmp_path / "sweep"
    args = [*FAST, "dist.world_size=1", "trainer.max_steps=4", "optimized_metric=val_loss_typo"]
    proc, left = cli(["-m", *args, f"hydra.sweep.dir={sweep}", "seed=0"], timeout=100)
    assert proc.returncode == 2 and not left, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: optimized_metric must be a numeric key of summary.json (")
    assert line.endswith(", got 'val_loss_typo'")
    assert "(test_loss, test_accuracy, val_loss, val_accuracy, steps, " in line
    assert any(sweep.glob("*/summary.json"))  # the finished run is kept

"""`python -m localsgd.report` on language-model runs, built by hand (summary.json, metrics.jsonl,
.hydra/): the metric the runs optimise leads (test loss, lower is better), row labels name only
what differs, one seed shows no spread, panels do not overlap, and a single run or one shorter
than trainer.eval_every still gets its loss curves. The one CLI run checks a finished run's own
plot."""

from __future__ import annotations

import csv
import json
import struct

import matplotlib.pyplot as plt
import pytest
import yaml

from localsgd.analysis.plots import plot_run
from localsgd.analysis.report import main as report_main

# What a data=text run's config holds beyond the command line: many keys the data group sets.
TEXT = {
    "_target_": "localsgd.data.datasets.text",
    "path": "/data/input.txt",
    "seq_len": 64,
    "test_fraction": 0.1,
    "partition": "iid",
}
SYNTHETIC = {
    "_target_": "localsgd.data.datasets.synthetic",
    "num_samples": 1200,
    "num_classes": 4,
    "dim": 16,
    "partition": "iid",
}


def make_run(
    path,
    overrides: list[str],
    *,
    period: int = 16,
    seed: int = 0,
    lm: bool = True,
    test_loss: float = 2.0,
    steps: int = 64,
    eval_every: int = 16,
):
    """A finished run directory as the trainer leaves it (the files the report reads)."""
    config = {
        "seed": seed,
        "optimized_metric": "test_loss" if lm else "test_accuracy",
        "data": TEXT if lm else SYNTHETIC,
        "model": {"_target_": "localsgd.models.transformer" if lm else "localsgd.models.mlp"},
        "trainer": {"max_steps": steps, "eval_every": eval_every, "log_every": 8},
        "sync": {"period": period, "warmup_steps": 0},
    }
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*overrides, f"seed={seed}"]))
    lines = []
    for step in range(8, steps + 1, 8):
        lines.append({"step": step, "loss": 4.0 - step / steps, "comm_bytes": 1000 * step})
        if step % eval_every == 0 or step == steps:
            test = {"test_loss": test_loss + 1 - step / steps, "test_accuracy": 0.3}
            lines.append({"step": step, **test, "comm_bytes": 1000 * step})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"test_loss": test_loss, "test_accuracy": 0.3, "test_perplexity": 2.718**test_loss,
               "steps": steps, "comm_rounds": steps // period, "comm_bytes": 1000 * steps,
               "wall_time_s": 3.0}  # fmt: skip
    if not lm:
        del summary["test_perplexity"]
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.timeout(60)
def test_a_language_model_report_leads_with_test_loss_and_names_only_what_differs(tmp_path, capsys):
    common = ["data=text", "data.path=/data/input.txt", "model=transformer", "optim=adamw"]
    for seed, loss in ((0, 1.8), (1, 1.9)):
        make_run(tmp_path / f"k16_s{seed}", [*common, "sync.period=16"], seed=seed, test_loss=loss)
    make_run(tmp_path / "k32_s0", [*common, "sync.period=32"], period=32, test_loss=2.1)
    assert report_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    header = printed.splitlines()[0]
    assert "test loss ↓" in header and "test perplexity ↓" in header, header
    assert "accuracy" not in header, header
    assert "| sync.period=16 | 2 | 1.8500 ± 0.0707 |" in printed, printed
    row = next(line for line in printed.splitlines() if line.startswith("| sync.period=32 |"))
    assert row == "| sync.period=32 | 1 | 2.1000 | 8.16 | 2 | 0.06 | 3.0 |", row
    assert "±" not in row  # one seed has no spread
    assert "test_loss,test_loss_std" in (tmp_path / "report.csv").read_text()
    for name in ("test_loss_vs_step.png", "train_loss_vs_step.png", "test_loss_vs_k.png"):
        assert _png_size(tmp_path / name)[0] > 300


@pytest.mark.timeout(60)
def test_runs_of_different_commands_are_labelled_by_their_differing_overrides(tmp_path, capsys):
    """A text run and a synthetic one differ in every key the data group sets: the configs
    alone made a label of hundreds of characters; the command lines say it in two words."""
    make_run(tmp_path / "lm", ["data=text", "data.path=/data/input.txt", "model=transformer"])
    make_run(tmp_path / "mlp", ["data=synthetic", "model=mlp"], lm=False)
    assert report_main([str(tmp_path), "--no-plots"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[2:] if line.startswith("|")]
    labels = sorted(line.split(" | ")[0].removeprefix("| ") for line in rows)
    assert labels == [
        "data=synthetic, model=mlp",
        "data=text, model=transformer",
    ], labels


@pytest.mark.timeout(60)
def test_a_single_run_shorter_than_eval_every_gets_its_loss_curves(tmp_path, capsys):
    run = make_run(tmp_path / "run", ["data=text", "sync.period=16"], steps=24, eval_every=100)
    assert report_main([str(run)]) == 0
    printed = capsys.readouterr().out
    assert "| all runs | 1 | 2.0000 |" in printed and "±" not in printed, printed
    assert "train_loss_vs_step.png" in printed and "_vs_k.png" not in printed
    assert _png_size(run / "train_loss_vs_step.png")[0] > 300
    path = plot_run(str(run))
    assert path == str(run / "loss_vs_step.png") and _png_size(run / "loss_vs_step.png")[0] > 300


@pytest.mark.long  # ~5 s of plotting: `make test-long` (the plot itself is checked above)
@pytest.mark.timeout(60)
def test_many_panels_with_long_titles_do_not_overlap(tmp_path, monkeypatch):
    """Seven settings besides the period: seven panels, titled by long labels. They were one row
    of panels whose titles ran into each other; now a grid whose figure grows with them."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep them to measure
    for i in range(7):
        setting = {"sync.outer_lr": round(0.1 * (i + 1), 2), "sync.outer_momentum": i / 20,
                   "optim.lr": (i + 1) / 10000, "model.d_model": 32 * (i + 1),
                   "model.n_heads": i + 1}  # fmt: skip
        for period in (16, 32):
            over = [f"{k}={v}" for k, v in setting.items()] + [f"sync.period={period}"]
            run = make_run(tmp_path / f"r{i}_{period}", over, period=period)
            config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
            for key, value in setting.items():
                node, leaf = key.split(".")
                config.setdefault(node, {})[leaf] = value
            (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    assert report_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    step_figure = figures[0]
    renderer = step_figure.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in step_figure.axes if ax.get_visible()]
    assert len(boxes) == 7
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    inside = step_figure.bbox
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 + 1 for b in boxes)
    monkeypatch.undo()
    for figure in figures:
        plt.close(figure)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_finished_language_model_run_writes_its_loss_plot(tmp_path):
    """data=text on a small file: the command prints where the run's plot is, the plot is
    there, and the report of that one run leads with its test loss."""
    from tests.helpers import FAST, cli

    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be, that is the question. " * 400)
    run_dir = tmp_path / "run"
    args = [a for a in FAST if not a.startswith(("data", "model", "logger.plots"))]
    proc, left = cli(
        args
        + ["data=text", f"data.path={text}", "model=transformer", "model.d_model=16"]
        + ["model.n_layers=1", "trainer.max_steps=12", "trainer.eval_every=100"]
        + ["trainer.log_every=4", "dist.world_size=2", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not left
    assert f"plot: {run_dir / 'loss_vs_step.png'}" in proc.stdout, proc.stdout
    assert _png_size(run_dir / "loss_vs_step.png")[0] > 300


@pytest.mark.timeout(30)
def test_a_plotting_error_is_one_warning_line_not_a_failed_run(tmp_path, capsys):
    from localsgd.cli.train import write_run_plot

    assert write_run_plot(str(tmp_path)) is None  # no summary.json to plot from
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: no plot written into {tmp_path}: ")


@pytest.mark.timeout(30)
def test_a_run_with_no_overrides_is_labelled_by_its_config(tmp_path, capsys):
    make_run(tmp_path / "default", [])
    make_run(tmp_path / "k64", ["sync.period=64"], period=64)
    assert report_main([str(tmp_path), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert "| sync.period=16 | 1 |" in printed and "| sync.period=64 (one-shot) | 1 |" in printed


def test_the_seeds_column_counts_seeds_not_runs(tmp_path, capsys):
    """Two runs of seed 0 that differ only in what grouping ignores (logger.*) are one seed."""
    make_run(tmp_path / "a", ["sync.period=16", "logger.plots=true"], seed=0)
    make_run(tmp_path / "b", ["sync.period=16", "logger.plots=false"], seed=0)
    make_run(tmp_path / "c", ["sync.period=16"], seed=1)
    assert report_main([str(tmp_path), "--no-plots"]) == 0
    assert "| 2 (3 runs) |" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert [(r["seeds"], r["runs"]) for r in rows] == [("2", "3")]

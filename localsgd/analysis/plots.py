"""The report's PNGs, and a finished run's own (matplotlib, Agg backend: no display needed).

Runs are split into panels by every varying key except `sync.period` (e.g. the partition), and
within a panel there is one line per period; each line is the mean over seeds. Panels fill a grid
whose figure grows with their number (constrained layout: titles and labels never overlap).
"""

from __future__ import annotations

import math
import os
import statistics
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from localsgd.analysis.runs import PERIOD, Group, Run, load_run  # noqa: E402

TITLES = {
    "test_accuracy": "test accuracy",
    "test_loss": "test loss",
    "test_perplexity": "test perplexity",
    "val_accuracy": "validation accuracy",
    "val_loss": "validation loss",
    "val_perplexity": "validation perplexity",
    "loss": "training loss",
}


def _title(metric: str) -> str:
    return TITLES.get(metric, metric)


def _stem(metric: str) -> str:
    """A metric's part of a file name (`accuracy_vs_step.png` as before for the default)."""
    return "accuracy" if metric in ("test_accuracy", "val_accuracy") else metric


def _wrap(text: str, width: int = 48) -> str:
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def _panels(groups: list[Group], keys: list[str]) -> dict[str, list[Group]]:
    panels: dict[str, list[Group]] = defaultdict(list)
    for g in groups:
        panels[g.without(PERIOD) if PERIOD in keys else g.label].append(g)
    return dict(panels)


def _line_label(g: Group, keys: list[str]) -> str | None:
    """`k=...` per period; None where a panel holds one group (its title names it)."""
    if PERIOD not in keys:
        return None
    k = g.config.get(PERIOD)
    one_shot = k is not None and k >= (g.config.get("trainer.max_steps") or float("inf"))
    return f"k={k}" + (" (one-shot)" if one_shot else "")


def _grid(n: int, sharey: bool = True, sharex: bool = False):
    """A figure of `n` panels, at most 4 a row, each about 4.6 x 3.4 inches."""
    ncols = min(n, max(1, math.ceil(math.sqrt(n))), 4)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(4.6 * ncols + 0.6, 3.4 * nrows + 0.5),
        squeeze=False,
        sharey=sharey,
        sharex=sharex,
        layout="constrained",
    )
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n], ncols


def mean_curve(g: Group, y_key: str, x_key: str) -> tuple[list[float], list[float]]:
    """Mean over seeds of `y_key`, at each step where it was logged, against the mean `x_key`."""
    ys: dict[int, list[float]] = defaultdict(list)
    xs: dict[int, list[float]] = defaultdict(list)
    for run in g.runs:
        for record in run.metrics:
            if y_key in record and x_key in record:
                ys[record["step"]].append(float(record[y_key]))
                xs[record["step"]].append(float(record[x_key]))
    steps = sorted(ys)
    return [statistics.fmean(xs[s]) for s in steps], [statistics.fmean(ys[s]) for s in steps]


def _plot(ax, x: list[float], y: list[float], **kw) -> None:
    # a run shorter than trainer.eval_every has one evaluation: a marker, not an empty axis
    ax.plot(x, y, marker="." if len(x) < 30 else None, markersize=8 if len(x) == 1 else 5, **kw)


def _nothing_logged(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes)


def _curves(groups, keys, y_key, x_key, xlabel, ylabel, title, path, logx=False) -> None:
    panels = _panels(groups, keys)
    fig, axes, ncols = _grid(len(panels))
    for i, (ax, (panel, members)) in enumerate(zip(axes, panels.items(), strict=True)):
        lengths = []
        for g in members:
            x, y = mean_curve(g, y_key, x_key)
            if x:
                _plot(ax, x, y, label=_line_label(g, keys))
                lengths.append(len(x))
        drawn = bool(lengths)
        if not drawn:
            _nothing_logged(ax, ylabel)
        elif max(lengths) == 1 and x_key == "step":  # runs shorter than trainer.eval_every
            ax.set_xlim(left=0)
            ax.text(0.03, 0.05, "one point: the final evaluation", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        if len(panels) > 1 or panel != "all runs":
            ax.set_title(_wrap(panel), fontsize=8)
        if logx and drawn:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if any(ax.get_legend_handles_labels()[1]):
            ax.legend(fontsize=7)
        if i % ncols == 0:  # the rows share the y axis
            ax.set_ylabel(ylabel)
    fig.suptitle(title + " (mean over seeds)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _final_vs_k(groups: list[Group], keys: list[str], metric: str, path: str) -> None:
    panels = _panels(groups, keys)
    by_k = PERIOD in keys
    named = by_k and len(panels) > 1  # one series per panel, in a legend beside the axes
    labels = [_wrap(panel, 50) for panel in panels] if named else []
    legend_lines = sum(label.count("\n") + 1 for label in labels)
    width = (6.0 if by_k else max(6.0, 1.0 * len(groups) + 1)) + (4.0 if named else 0)
    fig, ax = plt.subplots(figsize=(width, max(4.4, 0.19 * legend_lines + 1)), layout="constrained")
    for n, members in enumerate(panels.values()):
        xs, means, stds = [], [], []
        for g in members:
            values = g.values(metric)
            if not values:
                continue
            xs.append(g.config.get(PERIOD) if by_k else groups.index(g))
            means.append(statistics.fmean(values))
            stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=labels[n] if named else None)
    if by_k:
        ax.set_xscale("log", base=2)
        ks = sorted({g.config.get(PERIOD) for g in groups})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("k = sync.period (steps between averages)")
    else:
        names = [_wrap(g.label, 28) for g in groups]
        ax.set_xticks(range(len(groups)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"final {_title(metric)} (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    if named:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    ax.set_title(f"final {_title(metric)}" + (" vs k" if by_k else ""))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(
    groups: list[Group],
    keys: list[str],
    out: str,
    metric: tuple[str, bool] = ("test_accuracy", False),
) -> list[str]:
    """Write the report's PNGs into `out`; returns their file names. `metric`: the runs' metric
    and whether lower is better (`localsgd.analysis.runs.report_metric`)."""
    name, _ = metric
    final = test_of(name, groups)  # the final value: the test set's, read once at the end
    stem = _stem(name)
    written = [f"{stem}_vs_step.png", "train_loss_vs_step.png", "loss_vs_comm_bytes.png"]
    _curves(
        groups,
        keys,
        name,
        "step",
        "step",
        f"{_title(name)} (averaged model)",
        f"{_title(name)} vs step",
        os.path.join(out, written[0]),
    )
    _curves(
        groups,
        keys,
        "loss",
        "step",
        "step",
        "training loss",
        "training loss vs step",
        os.path.join(out, written[1]),
    )
    _curves(
        groups,
        keys,
        "loss",
        "comm_bytes",
        "bytes sent per worker",
        "training loss",
        "training loss vs communication",
        os.path.join(out, written[2]),
        logx=True,
    )
    if len(groups) > 1:  # one group's final value is the table's
        written.append(f"{stem}_vs_k.png")
        _final_vs_k(groups, keys, final, os.path.join(out, written[-1]))
    return written


def test_of(metric: str, groups: list[Group]) -> str:
    """A validation metric's test counterpart (`val_accuracy` -> `test_accuracy`) where the runs'
    summaries have it: what a final value is; the validation curve is what a sweep selected on."""
    if not metric.startswith("val_"):
        return metric
    test = "test_" + metric[len("val_") :]
    return test if any(g.values(test) for g in groups) else metric


RUN_PLOT = "loss_vs_step.png"


def plot_run(run_dir: str) -> str:
    """One finished run's curves, written into its directory as `loss_vs_step.png`: the
    training loss (rank 0's, as logged), the validation loss of the averaged model at each
    evaluation and the test loss (read at the end) against step, and beside them the run's
    `optimized_metric` where it is not a loss. Returns the file's path."""
    run = load_run(run_dir)
    metric = run.config.get("optimized_metric") or "test_accuracy"
    second = metric if metric not in ("test_loss", "val_loss", "loss") else None
    if second is not None and not any(second in r for r in run.metrics):
        second = None
    # one x axis: a run shorter than trainer.eval_every has one evaluation, at its last step
    fig, axes, _ = _grid(2 if second else 1, sharey=False, sharex=True)
    _run_panel(
        axes[0],
        run,
        ("loss", "training loss"),
        ("val_loss", "validation loss (averaged model)"),
        ("test_loss", "test loss (averaged model)"),
    )
    axes[0].set_ylabel("loss")
    if second:
        _run_panel(axes[1], run, (second, f"{_title(second)} (averaged model)"))
        axes[1].set_ylabel(_title(second))
    title = " ".join(o for o in run.overrides if not o.startswith(("hydra.", "logger.")))
    width = int(fig.get_figwidth() * 11)  # characters of 9 pt text across the figure
    fig.suptitle(_wrap(title or os.path.basename(os.path.abspath(run_dir)), width), fontsize=9)
    path = os.path.join(run_dir, RUN_PLOT)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_panel(ax, run: Run, *series: tuple[str, str]) -> None:
    drawn = False
    for key, name in series:
        points = [(r["step"], float(r[key])) for r in run.metrics if key in r and "step" in r]
        if points:
            steps, values = zip(*points, strict=True)
            _plot(ax, list(steps), list(values), label=name)
            drawn = True
    if not drawn:
        _nothing_logged(ax, " or ".join(name for _, name in series))
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)

"""The report's PNGs (matplotlib, Agg backend: no display needed).

Runs are split into panels by every varying key except `sync.period` (e.g. the partition), and
within a panel there is one line per period; each line is the mean over seeds.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from localsgd.analysis.runs import PERIOD, Group, label  # noqa: E402


def _panels(groups: list[Group], keys: list[str]) -> dict[str, list[Group]]:
    rest = [k for k in keys if k != PERIOD]
    panels: dict[str, list[Group]] = defaultdict(list)
    for g in groups:
        panels[label(g.config, rest) if rest else ""].append(g)
    return dict(panels)


def _line_label(g: Group, keys: list[str]) -> str:
    if PERIOD in keys:
        k = g.config.get(PERIOD)
        one_shot = k is not None and k >= (g.config.get("trainer.max_steps") or float("inf"))
        return f"k={k}" + (" (one-shot)" if one_shot else "")
    return g.label


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


def _curves(groups, keys, y_key, x_key, xlabel, ylabel, title, path, logx=False) -> None:
    panels = _panels(groups, keys)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False, sharey=True
    )
    for ax, (panel, members) in zip(axes[0], panels.items(), strict=True):
        for g in members:
            x, y = mean_curve(g, y_key, x_key)
            if x:
                ax.plot(x, y, marker="." if len(x) < 30 else None, label=_line_label(g, keys))
        ax.set_xlabel(xlabel)
        if panel:
            ax.set_title(panel, fontsize=9)
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title + " (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _final_vs_k(groups: list[Group], keys: list[str], path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for panel, members in _panels(groups, keys).items():
        xs, means, stds = [], [], []
        for i, g in enumerate(members):
            acc = g.values("test_accuracy")
            if not acc:
                continue
            xs.append(g.config.get(PERIOD) if PERIOD in keys else i)
            means.append(statistics.fmean(acc))
            stds.append(statistics.stdev(acc) if len(acc) > 1 else 0.0)
        ax.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=panel or None)
    if PERIOD in keys:
        ax.set_xscale("log", base=2)
        ks = sorted({g.config.get(PERIOD) for g in groups})
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel("k = sync.period (steps between averages; the largest is one-shot)")
    else:
        ax.set_xticks(range(len(groups)), [g.label for g in groups], rotation=30, fontsize=7)
    ax.set_ylabel("final test accuracy (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    if any(ax.get_legend_handles_labels()[1]):
        ax.legend(fontsize=7)
    ax.set_title("final test accuracy vs k")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(groups: list[Group], keys: list[str], out: str) -> list[str]:
    """Write the three PNGs into `out`; returns their file names."""
    _curves(
        groups,
        keys,
        "test_accuracy",
        "step",
        "step",
        "test accuracy (averaged model)",
        "test accuracy vs step",
        os.path.join(out, "accuracy_vs_step.png"),
    )
    _curves(
        groups,
        keys,
        "loss",
        "comm_bytes",
        "bytes sent per worker",
        "training loss",
        "training loss vs communication",
        os.path.join(out, "loss_vs_comm_bytes.png"),
        logx=True,
    )
    _final_vs_k(groups, keys, os.path.join(out, "accuracy_vs_k.png"))
    return ["accuracy_vs_step.png", "loss_vs_comm_bytes.png", "accuracy_vs_k.png"]

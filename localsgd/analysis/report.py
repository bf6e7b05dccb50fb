"""`python -m localsgd.report PATH [PATH ...]`: tables and plots from finished runs and sweeps.

A PATH is a directory or a run table. Every directory under a given one that holds a
`summary.json` is a run; its config comes from `.hydra/config.yaml` (and `.hydra/overrides.yaml`).
A run table (`*.jsonl`, written by `--export`) holds one run per line: its name, overrides,
config, summary and metrics curve, which is all a report needs, so a study keeps one file instead
of a Hydra output tree. Runs that differ only in `seed` form one row: mean +- std over the seeds of
the runs' `optimized_metric` (validation accuracy, and the test accuracy the final model reached;
the losses and test perplexity for language models),
communication rounds and bytes, and wall time. Writes `report.md`, `report.csv` and the PNGs into
`--out` (default: the first directory, or the table's folder).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
from typing import Any

from localsgd.analysis.runs import Group, Run, find_runs, group_runs, report_metric, table_row


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """The mean, and the std over seeds; None for one seed, which has no spread to show."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


TITLES = {
    "test_accuracy": "test accuracy",
    "test_loss": "test loss",
    "val_accuracy": "val accuracy",
    "val_loss": "val loss",
}
COMM = (
    ("comm_rounds", "comm rounds", "{:.0f}"),
    ("comm_bytes", "comm MB", "{:.2f}"),
    ("wall_time_s", "wall time s", "{:.1f}"),
)
COLUMNS = (("test_accuracy", "test accuracy ↑", "{:.4f}"), *COMM)  # a classification report's


def columns(runs: list[Run]) -> tuple[tuple[str, str, str], ...]:
    """The runs' `optimized_metric` first, with the way it improves (↑, ↓): a validation metric
    as its test value (the final model on the test set, read once) and then itself (what a
    sweep selected on); a language model's loss (nats per character) with its perplexity."""
    metric, lower = report_metric(runs)
    arrow = "↓" if lower else "↑"
    keys = [metric]
    if metric.startswith("val_"):
        test = "test_" + metric[len("val_") :]
        keys = [test, metric] if any(test in r.summary for r in runs) else keys
    lead = [(k, f"{TITLES.get(k, k)} {arrow}", "{:.4f}") for k in keys]
    if keys[0] == "test_loss" and any("test_perplexity" in r.summary for r in runs):
        lead.append(("test_perplexity", "test perplexity ↓", "{:.2f}"))
    return (*lead, *COMM)


def table_rows(groups: list[Group], cols=COLUMNS) -> list[dict[str, Any]]:
    rows = []
    for g in groups:
        # seeds, not runs: two runs of one seed (a config that differs only in what grouping
        # ignores, e.g. logger.*) are one seed twice
        row: dict[str, Any] = {
            "config": g.label,
            "seeds": len({r.seed for r in g.runs}),
            "runs": len(g.runs),
        }
        for key, _, _ in cols:
            values = g.values(key)
            if key == "comm_bytes":
                values = [v / 1e6 for v in values]
            row[key], row[key + "_std"] = mean_std(values)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], cols=COLUMNS) -> str:
    head = "| config | seeds | " + " | ".join(title for _, title, _ in cols) + " |"
    lines = [head, "|" + "---|" * (2 + len(cols))]
    for row in rows:
        runs = "" if row["runs"] == row["seeds"] else f" ({row['runs']} runs)"
        cells = [row["config"], f"{row['seeds']}{runs}"]
        for key, _, fmt in cols:
            std = row[key + "_std"]
            spread = "" if std is None else f" ± {fmt.format(std)}"
            cells.append(fmt.format(row[key]) + spread)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: list[dict[str, Any]], cols=COLUMNS) -> None:
    """`KEY_std` is empty for one run."""
    fields = ["config", "seeds", "runs"] + [k for key, _, _ in cols for k in (key, key + "_std")]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localsgd.report", description=__doc__)
    parser.add_argument(
        "dirs", nargs="+", help="sweep or run directories (searched recursively), or run tables"
    )
    parser.add_argument("--out", help="where to write the report (default: the first directory)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument(
        "--export", metavar="FILE", help="write the runs found as one run table (.jsonl) and stop"
    )
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.dirs)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(
            f"error: no finished run (summary.json) under {', '.join(args.dirs)}", file=sys.stderr
        )
        return 2
    if args.export:
        if not args.export.endswith(".jsonl") or os.path.exists(args.export):
            print(
                f"error: --export must name a new .jsonl file, got {args.export}", file=sys.stderr
            )
            return 2
        with open(args.export, "w", encoding="utf-8") as f:
            for run in runs:
                root = next(
                    d for d in args.dirs if os.path.abspath(run.path).startswith(os.path.abspath(d))
                )
                f.write(json.dumps(table_row(run, root)) + "\n")
        print(f"wrote {len(runs)} runs to {args.export}")
        return 0
    first = args.dirs[0]
    out = args.out or (os.path.dirname(first) or "." if os.path.isfile(first) else first)
    os.makedirs(out, exist_ok=True)
    groups, keys = group_runs(runs)
    cols = columns(runs)
    rows = table_rows(groups, cols)
    text = markdown(rows, cols)
    if groups[0].baseline:  # what the labels leave out, said once
        text = f"unless a row says otherwise: {groups[0].baseline}\n\n{text}"
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(
            f"{len(runs)} runs from {', '.join(args.dirs)}; mean ± std over seeds (one seed: "
            f"its value); ↑ higher is better, ↓ lower\n\n{text}"
        )
    write_csv(os.path.join(out, "report.csv"), rows, cols)
    print(text, end="")
    written = ["report.md", "report.csv"]
    if not args.no_plots:
        from localsgd.analysis.plots import plot_all  # matplotlib only when plotting

        written += plot_all(groups, keys, out, report_metric(runs))
    print(f"wrote {', '.join(os.path.join(out, name) for name in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

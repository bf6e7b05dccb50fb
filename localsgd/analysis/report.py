"""`python -m localsgd.report PATH [PATH ...]`: tables and plots from finished runs and sweeps.

A PATH is a directory or a run table. Every directory under a given one that holds a
`summary.json` is a run; its config comes from `.hydra/config.yaml` (and `.hydra/overrides.yaml`).
A run table (`*.jsonl`, written by `--export`) holds one run per line: its name, overrides,
config, summary and metrics curve, which is all a report needs, so a study keeps one file instead
of a Hydra output tree. Runs that differ only in `seed` form one row: mean +- std over the seeds of
the test accuracy, communication rounds and bytes, and wall time. Writes `report.md`, `report.csv`
and three PNGs into `--out` (default: the first directory, or the table's folder).
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

from localsgd.analysis.runs import Group, find_runs, group_runs, table_row


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


COLUMNS = (
    ("test_accuracy", "test accuracy", "{:.4f}"),
    ("comm_rounds", "comm rounds", "{:.0f}"),
    ("comm_bytes", "comm MB", "{:.2f}"),
    ("wall_time_s", "wall time s", "{:.1f}"),
)


def table_rows(groups: list[Group]) -> list[dict[str, Any]]:
    rows = []
    for g in groups:
        row: dict[str, Any] = {"config": g.label, "seeds": len(g.runs)}
        for key, _, _ in COLUMNS:
            values = g.values(key)
            if key == "comm_bytes":
                values = [v / 1e6 for v in values]
            row[key], row[key + "_std"] = mean_std(values)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| config | seeds | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (2 + len(COLUMNS))]
    for row in rows:
        cells = [row["config"], str(row["seeds"])]
        for key, _, fmt in COLUMNS:
            cells.append(f"{fmt.format(row[key])} ± {fmt.format(row[key + '_std'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    fields = ["config", "seeds"] + [k for key, _, _ in COLUMNS for k in (key, key + "_std")]
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
    rows = table_rows(groups)
    text = markdown(rows)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(f"{len(runs)} runs from {', '.join(args.dirs)}; mean ± std over seeds\n\n{text}")
    write_csv(os.path.join(out, "report.csv"), rows)
    print(text, end="")
    written = ["report.md", "report.csv"]
    if not args.no_plots:
        from localsgd.analysis.plots import plot_all  # matplotlib only when plotting

        written += plot_all(groups, keys, out)
    print(f"wrote {', '.join(os.path.join(out, name) for name in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Local SGD, post-local SGD and DiLoCo on character-level Shakespeare, side by side.

    make data                                           # the corpus, once
    python experiments/lm_shakespeare/study.py run      # 16 runs into /tmp/lm_shakespeare
    python experiments/lm_shakespeare/study.py export   # -> experiments/lm_shakespeare/runs.jsonl
    python experiments/lm_shakespeare/study.py report   # -> report.md and three plots

`run` skips runs that finished and resumes ones that were cut short, so it can be restarted.
`report` reads only the committed table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "runs.jsonl"
RUNS = Path(os.environ.get("LM_STUDY_DIR", "/tmp/lm_shakespeare"))
SEEDS = (0, 1)
STEPS = 2000
TARGET_LOSS = 2.0  # nats per character: the validation loss the time-to-target columns ask for

# A baby GPT (nanoGPT's CPU settings at half the width, so 4 workers fit 2 cores), AdamW inner
# steps as in DiLoCo (beta2 0.95, weight decay 0.1, warmup + cosine), 4 workers, batch 16 x 64
# characters each, and the slow link the comparison is about (1 Gbit/s, 100 ms per collective).
COMMON = [
    "data=shakespeare",
    "model=transformer",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_model=64",
    "optim=adamw",
    "optim.lr=0.002",
    "lr_schedule.warmup_steps=100",
    "dist.world_size=4",
    f"trainer.max_steps={STEPS}",
    "trainer.batch_size=16",
    "trainer.eval_every=200",
    "trainer.eval_samples=1024",
    "trainer.eval_batch_size=256",
    "trainer.log_every=50",
    "trainer.progress=false",
    "comm.simulate.bandwidth_gbps=1",
    "comm.simulate.latency_ms=100",
    "logger=jsonl",
]

ROWS = {
    # gradient all-reduce every step for the whole run: synchronous data-parallel AdamW
    "sync": [f"sync.warmup_steps={STEPS}", "sync.period=1"],
    "local_k16": ["sync.period=16"],
    "local_k64": ["sync.period=64"],
    "local_k256": ["sync.period=256"],
    "diloco_h16": ["sync=diloco", "sync.period=16"],
    "diloco_h64": ["sync=diloco", "sync.period=64"],
    "diloco_h256": ["sync=diloco", "sync.period=256"],
    "post_local_k64": ["sync.warmup_steps=500", "sync.period=64"],
}


def run_dir(row: str, seed: int) -> Path:
    return RUNS / f"{row}_s{seed}"


def run_all(rows: list[str]) -> None:
    for row in rows:
        for seed in SEEDS:
            out = run_dir(row, seed)
            if (out / "summary.json").is_file():
                continue
            cmd = [sys.executable, "-m", "localsgd.train", *COMMON, *ROWS[row], f"seed={seed}",
                   f"hydra.run.dir={out}"]  # fmt: skip
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)


def export() -> None:
    if TABLE.exists():
        TABLE.unlink()  # the table is regenerated whole from the run directories
    from localsgd.analysis.report import main as report_main

    sys.exit(report_main([str(RUNS), "--export", str(TABLE)]))


def row_of(run) -> str:
    return Path(run.path).name.rsplit("_s", 1)[0]


def first_at_target(run) -> dict | None:
    """The first periodic evaluation with validation loss at or below TARGET_LOSS."""
    for record in run.metrics:
        if record.get("test_loss", math.inf) <= TARGET_LOSS and "wall_time_s" in record:
            return record
    return None


def compute_per_step(runs) -> float:
    """Seconds of local computation per step, the median over all runs: the wall time less the
    communication time (which holds the simulated link's waits). Every row computes the same
    per step, so one figure serves all, and the machine's noise stays out of the modelled column."""
    return statistics.median(
        (r.summary["wall_time_s"] - r.summary["comm_seconds"]) / r.summary["steps"] for r in runs
    )


def fmt(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def report() -> None:
    from localsgd.analysis.runs import read_table

    runs = read_table(str(TABLE))
    by_row = defaultdict(list)
    for run in runs:
        by_row[row_of(run)].append(run)
    order = [r for r in ROWS if r in by_row]
    step_s = compute_per_step(runs)
    lines = [
        f"{len(runs)} runs from `runs.jsonl` (mean ± std over seeds {list(SEEDS)}). Validation "
        f"loss in nats per character. Communication per worker. Wall time: the training loop "
        f"on the simulated 1 Gbit/s, 100 ms link. Target: the first evaluation (every 200 steps, "
        f"at the next sync) with validation loss <= {TARGET_LOSS}; *measured* is its wall time, "
        f"*modelled* is steps x {step_s * 1e3:.1f} ms (the median computation per step over all "
        f"runs) + the run's own communication seconds up to then, which keeps the shared "
        f"machine's noise out.\n",
        "| row | seeds | val loss | perplexity | comm rounds | comm MB | wall s | "
        "steps to target | to target s, measured | to target s, modelled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in order:
        rs = by_row[row]
        hits = [h for h in (first_at_target(r) for r in rs) if h is not None]
        missing = "" if len(hits) == len(rs) else f" ({len(rs) - len(hits)} never)"
        lines.append(
            f"| {row} | {len(rs)} | {fmt([r.summary['test_loss'] for r in rs], 4)} "
            f"| {fmt([r.summary['test_perplexity'] for r in rs], 3)} "
            f"| {fmt([r.summary['comm_rounds'] for r in rs], 0)} "
            f"| {fmt([r.summary['comm_bytes'] / 1e6 for r in rs], 1)} "
            f"| {fmt([r.summary['wall_time_s'] for r in rs], 0)} "
            f"| {fmt([h['step'] for h in hits], 0)}{missing} "
            f"| {fmt([h['wall_time_s'] for h in hits], 0)} "
            f"| {fmt([h['step'] * step_s + h['comm_seconds'] for h in hits], 0)} |"
        )
    lines.append("\n## Samples (seed 0, the averaged model, temperature 0.8, 200 characters)\n")
    for row in order:
        first = min(by_row[row], key=lambda r: r.config.get("seed", 0))
        lines.append(f"**{row}**\n\n```\n{first.summary.get('sample', '').rstrip()}\n```\n")
    (HERE / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines[: 3 + len(order)]))
    plot(by_row, order)


def plot(by_row, order) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_spec = [
        ("step", "optimizer step", "loss_vs_step.png", 1.0),
        ("comm_bytes", "communication per worker (MB, log)", "loss_vs_comm_bytes.png", 1e6),
        ("wall_time_s", "wall time on the simulated 1 Gbit/s 100 ms link (s)",
         "loss_vs_sim_wall.png", 1.0),
    ]  # fmt: skip
    for x_key, xlabel, name, scale in axes_spec:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in order:
            points = defaultdict(list)
            for run in by_row[row]:
                for rec in run.metrics:
                    if "test_loss" in rec and x_key in rec:
                        points[rec["step"]].append((rec[x_key] / scale, rec["test_loss"]))
            steps = sorted(s for s in points if len(points[s]) == len(by_row[row]))
            xs = [statistics.fmean(p[0] for p in points[s]) for s in steps]
            ys = [statistics.fmean(p[1] for p in points[s]) for s in steps]
            style = "--" if row.startswith("diloco") else ":" if row == "sync" else "-"
            ax.plot(xs, ys, style, marker=".", label=row)
        if x_key == "comm_bytes":
            ax.set_xscale("log")
        ax.axhline(TARGET_LOSS, color="grey", lw=0.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_ylim(top=2.6)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(HERE / name, dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", choices=("run", "export", "report"))
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    if args.action == "run":
        run_all(args.rows)
    elif args.action == "export":
        export()
    else:
        report()


if __name__ == "__main__":
    main()

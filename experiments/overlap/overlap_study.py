"""Does `sync.overlap` pay? Blocking against delayed (overlapped) averaging on MNIST-1D.

Each run is `python -m localsgd.train +experiment=post_local_sgd` (4 CPU workers, the CNN, 3000
steps: `make train`'s job) with `sync.period` k and `sync.overlap` set, over three seeds, on two
links: this machine's own (gloo over loopback TCP, where the all-reduce is CPU work competing with
the training step for the same two cores) and a simulated link with 20 ms latency per collective
(`comm.simulate`; the wait runs in parallel with compute, as a NIC or NCCL's copy engines do).
Reports final test accuracy (mean and spread over seeds), wall time and the time rank 0 spent
blocked in communication. Writes experiments/overlap/overlap_study.{md,json,png}.

    python experiments/overlap/overlap_study.py            # 24 runs, ~15 min on 2 cores
    python experiments/overlap/overlap_study.py --tiny     # smoke test: 2 workers, a few steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
LINKS = {"loopback (real)": None, "simulated, 20 ms latency": 20.0}
PERIODS = (4, 16)
MODES = ("blocking", "overlap")


def run_one(latency: float | None, k: int, mode: str, seed: int, args, run_dir: str) -> dict:
    overrides = [
        "+experiment=post_local_sgd",
        f"dist.world_size={args.workers}",
        f"trainer.max_steps={args.steps}",
        "trainer.progress=false",
        "logger.wandb.mode=disabled",
        f"sync.period={k}",
        f"sync.warmup_steps={args.warmup}",
        f"sync.overlap={mode == 'overlap'}",
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
    ]
    if latency is not None:
        overrides.append(f"comm.simulate.latency_ms={latency}")
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"run k={k} {mode} seed={seed} latency={latency} failed: {error}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def _stats(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def render(results: dict, args, command: str) -> str:
    lines = [
        "# Blocking vs overlapped averaging (`sync.overlap`)",
        "",
        f"- command: `{command}`",
        f"- date: {results['date']}; load average at start/end: {results['load']}",
        f"- job: `+experiment=post_local_sgd` (MNIST-1D, CNN, {args.workers} CPU workers on one "
        f"2-core machine, {args.steps} steps, {args.warmup} synchronous warmup steps, batch "
        f"32/worker), seeds {', '.join(map(str, args.seeds))}",
        "- overlap: each average launched asynchronously at a sync and merged one step later, "
        "keeping that step's local progress (x <- mean(x_s) + (x_{s+1} - x_s))",
        "",
        "| link | k | averaging | test accuracy (mean ± sd) | wall s (median) "
        "| comm s, rank 0 (median) | rounds |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        runs = row["runs"]
        lines.append(
            f"| {row['link']} | {row['k']} | {row['mode']} | "
            f"{_stats([r['test_accuracy'] for r in runs])} | "
            f"{statistics.median(r['wall_time_s'] for r in runs):.1f} | "
            f"{statistics.median(r['comm_seconds'] for r in runs):.2f} | "
            f"{runs[0]['comm_rounds']} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels, acc, acc_sd, wall = [], [], [], []
    for row in results["rows"]:
        runs = row["runs"]
        short = "loopback" if row["link"].startswith("loopback") else "20 ms link"
        labels.append(f"{short}\nk={row['k']}\n{row['mode']}")
        values = [r["test_accuracy"] for r in runs]
        acc.append(statistics.mean(values))
        acc_sd.append(statistics.stdev(values) if len(values) > 1 else 0.0)
        wall.append(statistics.median(r["wall_time_s"] for r in runs))
    colors = ["tab:blue" if "blocking" in label else "tab:orange" for label in labels]
    xs = range(len(labels))
    axes[0].bar(xs, acc, yerr=acc_sd, color=colors, capsize=3)
    axes[0].set_ylim(min(acc) - 0.02, 1.0)
    axes[0].set_ylabel("test accuracy (mean ± sd over seeds)")
    axes[1].bar(xs, wall, color=colors)
    axes[1].set_ylabel("wall time s (median over seeds)")
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("blue: blocking averaging; orange: sync.overlap=true")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps, 2 workers, no outputs")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(HERE, "overlap_study"))
    parser.add_argument("--replot", action="store_true", help="redo .md/.png from the .json")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.warmup, args.workers, args.seeds = 40, 8, 2, [0]
    command = " ".join(["python experiments/overlap/overlap_study.py", *sys.argv[1:]])
    if args.replot:
        with open(args.out + ".json") as f:
            results = json.load(f)
        vars(args).update(results["args"])
        command = results["command"]
    else:
        load = load_average()
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        variants = [(link, k, mode) for link in LINKS for k in PERIODS for mode in MODES]
        rows = [{"link": link, "k": k, "mode": mode, "runs": []} for link, k, mode in variants]
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:  # every variant once per seed: load drifts hit all alike
                for i, row in enumerate(rows):
                    run_dir = os.path.join(tmp, f"{i}-{seed}")
                    latency = LINKS[row["link"]]
                    row["runs"].append(run_one(latency, row["k"], row["mode"], seed, args, run_dir))
                    print(
                        f"seed {seed}: {row['link']} k={row['k']} {row['mode']}: "
                        f"{row['runs'][-1]['test_accuracy']}",
                        flush=True,
                    )
        results = {
            "rows": rows,
            "date": date,
            "load": f"{load} / {load_average()}",
            "args": {k: getattr(args, k) for k in ("steps", "warmup", "workers", "seeds")},
            "command": command,
        }
    text = render(results, args, command)
    print(text)
    if args.tiny:
        return
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    plot(results, args.out + ".png")


if __name__ == "__main__":
    main()

"""Time to target accuracy on MNIST-1D over a simulated 10 Gbit/s and 100 Mbit/s network.

Each run is `python -m localsgd.train` (4 CPU workers, the MLP) with `comm.simulate` set, so every
collective lasts at least `latency + bytes / bandwidth`; the runs differ only in the link and the
strategy: local SGD with k = 1, 16, 64, k = 16 with `sync.overlap`, and DiLoCo
(`+experiment=diloco`: H = 50, inner AdamW, outer Nesterov).
The wall clock of each evaluation (taken before it, in metrics.jsonl) gives accuracy against
time. Writes experiments/simulate/simulate_study.{md,json,png}.

    python experiments/simulate/simulate_study.py            # 6 runs, ~5 min on 2 cores
    python experiments/simulate/simulate_study.py --tiny     # smoke test: 2 workers, a few steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
LINKS = {  # name: (bandwidth_gbps, latency_ms)
    "10 Gbit/s, 0.1 ms": (10.0, 0.1),
    "100 Mbit/s, 10 ms": (0.1, 10.0),
}
VARIANTS = {  # name: overrides
    "k=1": ["sync.period=1"],
    "k=16": ["sync.period=16"],
    "k=64": ["sync.period=64"],
    "k=16 overlap": ["sync.period=16", "sync.overlap=true"],
    # the paper's outer step, as the committed results ran (the preset now warms it up)
    "DiLoCo H=50": ["+experiment=diloco", "sync.outer_warmup_rounds=0"],
}


def run_one(bandwidth: float, latency: float, variant: str, args, run_dir: str) -> dict:
    overrides = [
        "data=mnist1d",
        "model=mlp",
        f"dist.world_size={args.workers}",
        f"trainer.max_steps={args.steps}",
        f"trainer.eval_every={args.eval_every}",
        "trainer.progress=false",
        *VARIANTS[variant],
        "sync.warmup_steps=0",
        f"comm.simulate.bandwidth_gbps={bandwidth}",
        f"comm.simulate.latency_ms={latency}",
        f"seed={args.seed}",
        f"hydra.run.dir={run_dir}",
    ]
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-m", "localsgd.train", *overrides],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode == 0:
            break
        error = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        print(f"run {variant} at {bandwidth} Gbit/s, try {attempt}, failed: {error[0]}", flush=True)
        if attempt == 2:
            raise SystemExit(f"run {variant} at {bandwidth} Gbit/s failed twice")
        run_dir += "-retry"  # a fresh directory: the CLI refuses to reuse a finished one
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    evals = [r for r in records if "test_accuracy" in r]
    # The final evaluation has no wall time of its own: it follows the loop (and final average).
    curve = [(r.get("wall_time_s", summary["wall_time_s"]), r["test_accuracy"]) for r in evals]
    return {"summary": summary, "curve": curve}


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


def render(results: dict, args, command: str) -> str:
    lines = [
        "# Time to target accuracy over a simulated network (`comm.simulate`)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- job: MNIST-1D, MLP [256, 256], {args.workers} CPU workers on one machine, "
        f"{args.steps} steps, batch 32/worker, SGD momentum 0.9, cosine LR 0.1 (DiLoCo: inner "
        f"AdamW lr 0.003, weight decay 0.1), evaluation every {args.eval_every} steps (at the next "
        f"sync; with overlap, the next merge), seed {args.seed}",
        f"- target test accuracy: {args.target}",
        "",
        "| link | strategy | time to target s | final accuracy | wall s | comm s (rank 0) "
        "| rounds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for link, runs in results.items():
        for k, run in runs.items():
            s = run["summary"]
            t = time_to(run["curve"], args.target)
            lines.append(
                f"| {link} | {k} | {'not reached' if t is None else f'{t:.1f}'} | "
                f"{s['test_accuracy']:.3f} | {s['wall_time_s']:.1f} | {s['comm_seconds']:.1f} | "
                f"{s['comm_rounds']} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True)
    for ax, (link, runs) in zip(axes, results.items(), strict=True):
        for k, run in runs.items():
            ts, accs = zip(*run["curve"], strict=True)
            ax.plot(ts, accs, marker=".", label=k)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(link)
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (averaged model)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few steps, 2 workers, no outputs")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(HERE, "simulate_study"))
    parser.add_argument("--replot", action="store_true", help="redo .md/.png from the .json")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.workers, args.eval_every = 40, 2, 10
    command = " ".join(["python experiments/simulate/simulate_study.py", *sys.argv[1:]])
    if args.replot:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        for key in ("steps", "workers", "eval_every", "seed"):
            setattr(args, key, saved["args"][key])
        command = saved["command"]
        write_outputs(saved["results"], args, command)
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for link, (bandwidth, latency) in LINKS.items():
            results[link] = {}
            for i, k in enumerate(VARIANTS):
                run_dir = os.path.join(tmp, f"{bandwidth}-{i}")
                results[link][k] = run_one(bandwidth, latency, k, args, run_dir)
                s = results[link][k]["summary"]
                print(f"{link} {k}: acc {s['test_accuracy']:.3f} in {s['wall_time_s']} s",
                      flush=True)  # fmt: skip
    if args.tiny:
        print(render(results, args, command), end="")
        return
    with open(args.out + ".json", "w") as f:
        saved_args = {k: getattr(args, k) for k in ("steps", "workers", "eval_every", "seed")}
        json.dump({"command": command, "args": saved_args, "results": results}, f, indent=1)
    write_outputs(results, args, command)


def write_outputs(results: dict, args, command: str) -> None:
    text = render(results, args, command)
    print(text, end="")
    with open(args.out + ".md", "w") as f:
        f.write(text)
    plot(results, args.target, args.out + ".png")


if __name__ == "__main__":
    main()

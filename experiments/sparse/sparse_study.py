"""Sparse against 4-bit pseudo-gradients on MNIST-1D (issue 30, item 1): bytes per parameter per
step and loss, beside synchronous AdamW, at 2 and 4 workers.

Each run is `python -m localsgd.train` (the MLP, 78,858 parameters; inner AdamW at lr 3e-3, the
lr experiment=diloco gives a small model; 1000 steps of 32 samples per worker; H = 32, so 31
outer rounds). Rows, all fixed before any was run (nothing tuned):

- `sync`: synchronous AdamW, the gradients all-reduced every step (`sync.warmup_steps` = all);
- `diloco_int4ef`: DiLoCo (`sync=diloco`: outer Nesterov, lr 0.7, momentum 0.9, warmed up over
  4 rounds) with 4-bit pseudo-gradients and error feedback, today's best in bytes;
- `sparseloco`: the `sync=sparseloco` preset: top-k 64 of every 4096 values, 2-bit values,
  error feedback, outer SGD at lr 1 without momentum;
- `diloco_topk`: the same top-k messages under DiLoCo's outer Nesterov step (is error feedback
  a replacement for outer momentum, or do both help?);
- `sparseloco_d16` and `sparseloco_h8`: 4x the bytes of `sparseloco` two ways, 4x the density
  (256 of 4096) at H = 32, or the same density every 8 steps (added after the first four rows
  were seen, with `--rows ... --append`; fixed before they ran, not tuned);
- `sparseloco_b95`: the preset with the residual decayed, `e <- 0.95 e + d`
  (`sync.error_feedback_decay=0.95`; added the same way);
- `sparseloco_sb95`: that decay with each index divided by the workers that sent it
  (`sync.topk_mean=senders`, SparseLoCo's reference aggregation; added last, after the
  Shakespeare LM's probes chose the pair, experiments/lm_shakespeare/sparse_probes.md: a check
  on a job it was not chosen on, nothing tuned here).

The gap of each row is its final test loss against `sync`'s at the same world size and seed.
Bytes per parameter per step: `comm_bytes` (what one worker sent) / (parameters x steps).
Writes experiments/sparse/sparse_study.{md,json}.

    python experiments/sparse/sparse_study.py                       # 24 runs, ~8 min on 2 cores
    python experiments/sparse/sparse_study.py --seeds 0 --workers 2 --steps 40   # a smoke run
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
H = 32


def rows(steps: int) -> dict[str, list[str]]:
    return {
        "sync": ["sync.period=1", f"sync.warmup_steps={steps}"],
        "diloco_int4ef": [
            "sync=diloco", f"sync.period={H}", "sync.comm_dtype=int4", "sync.error_feedback=true"
        ],
        "sparseloco": ["sync=sparseloco", f"sync.period={H}"],
        "diloco_topk": [
            "sync=diloco", f"sync.period={H}", "sync.compress=topk", "sync.error_feedback=true"
        ],
        # the same bytes two ways: 4x the density at H = 32, or the same density 4x as often
        "sparseloco_d16": ["sync=sparseloco", f"sync.period={H}", "sync.topk_density=0.0625"],
        "sparseloco_h8": ["sync=sparseloco", "sync.period=8"],
        # SparseLoCo's decayed accumulator, e <- 0.95 e + d (the value fixed before it ran)
        "sparseloco_b95": ["sync=sparseloco", f"sync.period={H}", "sync.error_feedback_decay=0.95"],
        # ... with each index divided by the workers that sent it (the reference's aggregation)
        "sparseloco_sb95": ["sync=sparseloco", f"sync.period={H}", "sync.error_feedback_decay=0.95",
                            "sync.topk_mean=senders"],
    }  # fmt: skip


def run_one(row: list[str], workers: int, seed: int, steps: int, run_dir: str) -> dict:
    overrides = [
        "data=mnist1d",
        "model=mlp",
        "optim=adamw",
        "optim.lr=0.003",
        f"dist.world_size={workers}",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.checkpoint_every=0",
        "trainer.progress=false",
        "logger.wandb.mode=disabled",
        "logger.plots=false",
        *row,
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def _restated(result: dict) -> tuple[int, bool]:
    """A result's `comm_bytes` as today's top-k wire counts them, and whether it was restated
    from int16 indices (the runs before 2026-12-05; `localsgd.analysis.restate`, exact)."""
    from localsgd.analysis.restate import restate_run

    config = dict(o.split("=", 1) for o in rows(result["steps"])[result["row"]])
    if config.get("sync") == "sparseloco":
        config.setdefault("sync.compress", "topk")
    summary = {k: result[k] for k in ("comm_bytes", "comm_rounds", "params")}
    int16 = restate_run(summary, config)
    return summary["comm_bytes"], int16


def _bytes_per_param_step(result: dict) -> float:
    return _restated(result)[0] / (result["params"] * result["steps"])


def write(out: str, commands: list[str], results: list[dict]) -> None:
    with open(out + ".json", "w") as f:
        json.dump({"commands": commands, "results": results}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(
            "# Sparse (top-k, 2 bits) against 4-bit pseudo-gradients on MNIST-1D\n\n"
            "Made by (2 shared CPU cores; the script's docstring gives the setting; raw runs: "
            "sparse_study.json):\n\n" + "".join(f"    {c}\n" for c in commands) + "\n"
            "Bytes per parameter per step as today's top-k wire counts them: those marked * "
            "were sent with int16 indices (before 2026-12-05) and are restated for the "
            "Elias-Fano indices by `python experiments/sparse/sparse_study.py --report` "
            "(`localsgd.analysis.restate`: exact; the positions, values and models are the "
            "same bits).\n\n" + "\n".join(table(results)) + "\n"
        )


def table(results: list[dict]) -> list[str]:
    lines = [
        "| row | workers | seeds | test loss | gap to sync (per seed) | test accuracy "
        "| bytes / param / step | x fewer than sync |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["row"], r["workers"], r["seed"]): r for r in results}
    names = list(dict.fromkeys(r["row"] for r in results))
    for workers in sorted({r["workers"] for r in results}):
        for name in names:
            runs = [r for r in results if r["row"] == name and r["workers"] == workers]
            if not runs:
                continue
            loss = [r["test_loss"] for r in runs]
            gaps = [r["test_loss"] / by["sync", workers, r["seed"]]["test_loss"] - 1 for r in runs]
            bpps = statistics.mean(_bytes_per_param_step(r) for r in runs)
            sync_bpps = statistics.mean(
                _bytes_per_param_step(by["sync", workers, r["seed"]]) for r in runs
            )
            restated = any(_restated(r)[1] for r in runs)
            spread = statistics.stdev(loss) if len(loss) > 1 else 0.0
            lines.append(
                f"| {name} | {workers} | {len(runs)} | {statistics.mean(loss):.4f} ± {spread:.4f} "
                f"| {', '.join(f'{g:+.1%}' for g in gaps)} "
                f"| {statistics.mean(r['test_accuracy'] for r in runs):.3f} "
                f"| {bpps:.6f}{' *' if restated else ''} | {sync_bpps / bpps:.0f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rows", nargs="+", default=None, help="row names (default: all)")
    parser.add_argument("--append", action="store_true", help="add to the results in --out")
    parser.add_argument("--report", action="store_true", help="only rewrite --out's .md")
    parser.add_argument("--out", default=os.path.join(HERE, "sparse_study"))
    args = parser.parse_args()
    results, commands = [], []
    if args.report:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        write(args.out, saved["commands"], saved["results"])
        return
    if args.append:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        results = saved["results"]
        commands = saved.get("commands") or [saved["command"]]  # the first version wrote one
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            for seed in args.seeds:
                for name, row in rows(args.steps).items():
                    if args.rows is not None and name not in args.rows:
                        continue
                    if args.rows is None and name.startswith("sparseloco_"):
                        continue  # the added rows: --rows names them
                    run_dir = os.path.join(tmp, f"{name}_w{workers}_s{seed}")
                    s = run_one(row, workers, seed, args.steps, run_dir)
                    bpps = s["comm_bytes"] / (s["params"] * s["steps"])
                    results.append({
                        "row": name, "workers": workers, "seed": seed,
                        "test_loss": s["test_loss"], "test_accuracy": s["test_accuracy"],
                        "comm_bytes": s["comm_bytes"], "comm_rounds": s["comm_rounds"],
                        "params": s["params"], "steps": s["steps"],
                        "bytes_per_param_step": bpps, "wall_time_s": s["wall_time_s"],
                    })  # fmt: skip
                    print(json.dumps(results[-1]), flush=True)
    given = [("steps", args.steps), ("seeds", args.seeds), ("workers", args.workers)]
    given += [("rows", args.rows)] if args.rows else []
    command = (
        "python experiments/sparse/sparse_study.py "
        + " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in given)
        + (" --append" if args.append else "")
    )
    commands.append(f"{command}  ({datetime.date.today()})")
    write(args.out, commands, results)


if __name__ == "__main__":
    main()

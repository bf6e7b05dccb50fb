"""One worker of 4 three times slower: how much of the straggler-free throughput the others
keep, blocking (every sync waits for it) against a time budget (`sync.inner_time_s`: it
computes fewer of a round's steps, the average weighs each worker by its samples).

Each run is `python -m localsgd.train` on MNIST-1D (4 CPU workers, the MLP, no warmup) with
the deterministic slow-worker model: worker r's step lasts `comm.simulate.worker_speed[r]` x
`comm.simulate.step_s` seconds of wall clock (slept out past its compute), so the runs repeat
on a busy machine. Per seed and strategy, side by side in this one process:

- `free`: worker_speed [1, 1, 1, 1] (every step padded to step_s alike);
- `blocking`: [1, 1, 1, 3];
- `budget`: [1, 1, 1, 3] with sync.inner_time_s = H x step_s (a round's steps at speed 1);
- `blocking, same time`: [1, 1, 1, 3] for a third of the steps (the budget run's wall time);
- `free, same samples`: [1, 1, 1, 1] for the steps at which the fleet has trained on the samples
  the budget run merged (its `contributed_samples`): what is left of the budget run's loss gap
  once the slow worker's missing compute is discounted is the merge's own cost.

Throughput is rank 0's (a fast worker's) computed samples over its training seconds (wall time
less the periodic evaluations); the ratio is against `free` of the same seed. Writes
experiments/straggler_study.{md,json}.

    python experiments/straggler_study.py --steps 600 --step-s 0.015  # as committed, ~10 min
    python experiments/straggler_study.py --tiny     # smoke test: 1 seed, a few steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = {  # name: (overrides, H)
    "local SGD H=16": (["sync.period=16"], 16),
    "DiLoCo H=50": (["+experiment=diloco", "sync.outer_warmup_rounds=0"], 50),
}
SPEEDS = {
    "free": "[1,1,1,1]",
    "blocking": "[1,1,1,3]",
    "budget": "[1,1,1,3]",
    "blocking, same time": "[1,1,1,3]",  # a third of the steps: the budget run's modelled time
    "free, same samples": "[1,1,1,1]",  # as many samples as the budget run merged (after it)
}


def run_one(
    strategy: str, condition: str, seed: int, args, run_dir: str, steps: int | None = None
) -> dict:
    overrides, period = STRATEGIES[strategy]
    budget = [f"sync.inner_time_s={period * args.step_s}"] if condition == "budget" else []
    if steps is None:
        steps = args.steps // 3 if condition == "blocking, same time" else args.steps
    command = [
        sys.executable, "-m", "localsgd.train", *overrides,
        "data=mnist1d", "model=mlp", "dist.world_size=4", "sync.warmup_steps=0",
        f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
        "trainer.progress=false", "trainer.checkpoint_every=0", "logger.plots=false",
        f"comm.simulate.worker_speed={SPEEDS[condition]}", f"comm.simulate.step_s={args.step_s}",
        *budget, f"seed={seed}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} {condition} seed {seed} failed: {proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    seconds = s["wall_time_s"] - s["eval_seconds"]
    computed = s.get("computed_steps", s["steps"])
    return {
        "samples_per_s": computed * 32 / seconds,  # rank 0's, batch 32
        "test_loss": s["test_loss"],
        "test_accuracy": s["test_accuracy"],
        "wall_time_s": s["wall_time_s"],
        "round_weights": s.get("round_weights"),
        "wait_s": s.get("wait_s"),
        "contributed_samples": s.get("contributed_samples"),
        "steps": s["steps"],
    }


def same_samples_steps(budget: dict, steps: int) -> int:
    """The steps at which the straggler-free fleet has trained on what the budget run merged:
    its loss is the budget run's target once the slow worker's missing compute is discounted."""
    return round(budget["contributed_samples"] / (4 * 32 * steps) * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--step-s", type=float, default=0.01)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.seeds, args.steps = [0], 100
    runs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for strategy in STRATEGIES:
                for condition in SPEEDS:
                    name = f"{strategy}-{condition}-{seed}"
                    name = name.replace(" ", "_").replace("=", "").replace(",", "")
                    run_dir = os.path.join(tmp, name)
                    steps = None
                    if condition == "free, same samples":
                        budget = runs[strategy]["budget"][seed]
                        steps = same_samples_steps(budget, args.steps)
                    r = run_one(strategy, condition, seed, args, run_dir, steps)
                    runs.setdefault(strategy, {}).setdefault(condition, {})[seed] = r
                    print(strategy, condition, seed, json.dumps(r), flush=True)
    rows = []
    for strategy, by_condition in runs.items():
        free, short = by_condition["free"], by_condition["blocking, same time"]
        matched = by_condition["free, same samples"]
        for condition in ("blocking", "budget"):
            got = by_condition[condition]
            speed = [got[s]["samples_per_s"] / free[s]["samples_per_s"] for s in args.seeds]
            loss = [got[s]["test_loss"] / free[s]["test_loss"] - 1 for s in args.seeds]
            timed = [got[s]["test_loss"] / short[s]["test_loss"] - 1 for s in args.seeds]
            fair = [got[s]["test_loss"] / matched[s]["test_loss"] - 1 for s in args.seeds]
            accuracy = [got[s]["test_accuracy"] - free[s]["test_accuracy"] for s in args.seeds]
            rows.append((strategy, condition, speed, loss, timed, fair, accuracy))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# One worker of 4 three times slower: blocking against a time budget",
        "",
        f"Run {stamp}, `python experiments/straggler_study.py` ({len(args.seeds)} seeds, "
        f"{args.steps} steps, step_s {args.step_s} s); MNIST-1D, 4 CPU workers, gloo. "
        "Ratios are against the straggler-free run of the same seed and strategy, measured in "
        "the same invocation.",
        "",
        "| strategy | slow worker | rank 0 samples/s vs free (per seed) | final test loss vs "
        "free, same steps (per seed) | test accuracy vs free, points | vs blocking at the same "
        "wall time | vs free at the samples the budget run merged |",
        "|---|---|---|---|---|---|---|",
    ]
    for strategy, condition, speed, loss, timed, fair, accuracy in rows:
        budget = condition == "budget"
        lines.append(
            f"| {strategy} | {condition} | {', '.join(f'{x:.3f}' for x in speed)} | "
            f"{', '.join(f'{x:+.1%}' for x in loss)} | "
            f"{', '.join(f'{100 * x:+.1f}' for x in accuracy)} | "
            + (", ".join(f"{x:+.1%}" for x in timed) if budget else "")
            + " | "
            + (", ".join(f"{x:+.1%}" for x in fair) if budget else "")
            + " |"
        )
    out = os.path.join(ROOT, "experiments", "straggler_study")
    if not args.tiny:
        with open(out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(out + ".json", "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

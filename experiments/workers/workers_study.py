r"""DiLoCo against synchronous training as the number of workers M grows (issue 30, item 5,
"Workers"), with AdamW and with Muon inner steps, on MNIST-1D or the Shakespeare LM, with
virtual workers.

    python experiments/workers/workers_study.py --workers 1 2 4 8 16 --seeds 0 1 --steps 1000
    python experiments/workers/workers_study.py --setting lm --workers 1 4 16 --seeds 0 1 2 \
        --steps 1000
    # one worker on the 4 windows each of 16 workers steps on (a diagnostic: the LM's reading)
    python experiments/workers/workers_study.py --setting lm --workers 1 --seeds 0 1 2 \
        --steps 1000 --rows sync_adamw sync_muon --global-batch 4 \
        --out experiments/workers/workers_study_lm_batch4

Every run is `python -m localsgd.train ... dist.virtual_workers=M` (the M workers as threads of
one process, bit-identical to M gloo processes: tests/test_virtual.py). The setting of the DiLoCo
scaling-law study (Charles et al. 2025): a fixed global batch of 256 samples a step, each
worker's batch 256 / M, and the same number of steps at every M, so every run trains on the same
number of samples with the same compute. The MLP (78,858 parameters), inner lr 3e-3 for both
optimizers (Muon's update is scaled to AdamW's RMS: conf/optim/muon.yaml), the cosine schedule,
H = 32 for DiLoCo (sync=diloco: outer Nesterov, lr 0.7, momentum 0.9, warmed up over 4 rounds).

`--setting lm` (added 2026-12-06, after the MNIST-1D study was seen; fixed before any LM run):
the Shakespeare study's baby GPT (experiments/lm_shakespeare: 4 layers, width 64, 215k
parameters), a global batch of 64 windows of 64 characters (the 4-worker study's 4 x 16), inner
lr 2e-3 for both optimizers with 100 warmup steps and the cosine decay, H = 16 (that study's
DiLoCo period), the test loss on 1024 validation windows (`make data` builds the corpus).

Rows, all fixed before any was run (nothing tuned):

- `sync_adamw`, `sync_muon`: synchronous training, the gradients all-reduced every step
  (`sync.warmup_steps` = all the steps): one model, a batch of 256;
- `diloco_adamw`, `diloco_muon`: DiLoCo with that inner optimizer.

The gap of a DiLoCo row is its final test loss against the sync row with the same inner
optimizer at the same M and seed (MuLoCo's comparison), and against `sync_adamw`.
Writes experiments/workers/workers_study.{md,json}; `--append` adds runs to them.
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
# per setting: the global batch, DiLoCo's H and the job's overrides
SETTINGS = {
    "mnist1d": (256, 32, ["data=mnist1d", "model=mlp", "optim.lr=0.003"]),
    "lm": (64, 16, [
        "data=shakespeare", "model=transformer", "model.n_layers=4", "model.n_heads=4",
        "model.d_model=64", "optim.lr=0.002", "lr_schedule.warmup_steps=100",
        "trainer.eval_samples=1024", "trainer.eval_batch_size=256", "logger=jsonl",
    ]),
}  # fmt: skip
_OUT = os.path.join(HERE, "workers_study")


def rows(steps: int, period: int) -> dict[str, list[str]]:
    """The four rows; `period`: DiLoCo's H (the setting's)."""
    sync = ["sync.period=1", f"sync.warmup_steps={steps}"]
    diloco = ["sync=diloco", f"sync.period={period}"]
    return {
        "sync_adamw": ["optim=adamw", *sync],
        "sync_muon": ["optim=muon", *sync],
        "diloco_adamw": ["optim=adamw", *diloco],
        "diloco_muon": ["optim=muon", *diloco],
    }


def run_one(
    row: list[str], workers: int, seed: int, steps: int, samples: int, run_dir: str,
    setting: str = "mnist1d", global_batch: int | None = None,
) -> dict:  # fmt: skip
    """One job; `global_batch`: split among the workers (None: the setting's)."""
    global_batch = global_batch or SETTINGS[setting][0]
    data = [f"data.num_samples={samples}"] if setting == "mnist1d" else []
    overrides = [
        *SETTINGS[setting][2],
        *data,
        *row,
        f"dist.virtual_workers={workers}",
        f"trainer.batch_size={global_batch // workers}",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.checkpoint_every=0",
        "trainer.progress=false",
        "logger.wandb.mode=disabled",
        "logger.plots=false",
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:  # the last logged training loss
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    return {**summary, "train_loss": losses[-1]}


def _gaps(results: list[dict], name: str, workers: int, against: str) -> list[float]:
    by = {(r["row"], r["workers"], r["seed"]): r for r in results}
    out = []
    for r in results:
        if r["row"] == name and r["workers"] == workers and (against, workers, r["seed"]) in by:
            out.append(r["test_loss"] / by[against, workers, r["seed"]]["test_loss"] - 1)
    return out


def _points(results: list[dict], name: str, workers: int, against: str) -> str:
    """Test accuracy minus the sync row's, in points, per seed ("-" for a sync row)."""
    if not name.startswith("diloco"):
        return "-"
    by = {(r["row"], r["workers"], r["seed"]): r for r in results}
    out = [
        100 * (r["test_accuracy"] - by[against, workers, r["seed"]]["test_accuracy"])
        for r in results
        if r["row"] == name and r["workers"] == workers and (against, workers, r["seed"]) in by
    ]
    return ", ".join(f"{p:+.1f}" for p in out) or "-"


def _train(runs: list[dict]) -> str:
    """The mean training loss (recorded from the second study on; "-" where not)."""
    losses = [r["train_loss"] for r in runs if "train_loss" in r]
    return f"{statistics.mean(losses):.4f}" if losses else "-"


def _pct(values: list[float]) -> str:
    return ", ".join(f"{v:+.1%}" for v in values) or "-"


def table(results: list[dict]) -> list[str]:
    lines = [
        "| M | batch / worker | row | seeds | test loss | test accuracy | loss gap to sync, "
        "same optimizer (per seed) | loss gap to sync_adamw (per seed) | accuracy vs sync, "
        "same optimizer (points, per seed) | train loss (rank 0, last 25 steps) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = list(rows(1, 1))
    for workers in sorted({r["workers"] for r in results}):
        for name in names:
            runs = [r for r in results if r["row"] == name and r["workers"] == workers]
            if not runs:
                continue
            loss = [r["test_loss"] for r in runs]
            spread = statistics.stdev(loss) if len(loss) > 1 else 0.0
            own = "sync_" + name.split("_")[1]
            same = _gaps(results, name, workers, own) if name.startswith("diloco") else []
            adamw = _gaps(results, name, workers, "sync_adamw") if name != "sync_adamw" else []
            lines.append(
                f"| {workers} | {runs[0].get('batch_per_worker', 256 // workers)} | {name} "
                f"| {len(runs)} "
                f"| {statistics.mean(loss):.4f} ± {spread:.4f} "
                f"| {statistics.mean(r['test_accuracy'] for r in runs):.3f} "
                f"| {_pct(same)} | {_pct(adamw)} | {_points(results, name, workers, own)} "
                f"| {_train(runs)} "
                f"| {statistics.mean(r['wall_time_s'] for r in runs):.1f} |"
            )
    return lines


def ratio_lines(results: list[dict]) -> list[str]:
    """Per M and seed: Muon DiLoCo's gap to sync_muon over AdamW DiLoCo's gap to sync_adamw
    (the issue's target: at most 0.5 at M = 16)."""
    lines = [
        "| M | seed | AdamW DiLoCo gap | Muon DiLoCo gap | Muon / AdamW |",
        "|---|---|---|---|---|",
    ]
    for workers in sorted({r["workers"] for r in results}):
        for seed in sorted({r["seed"] for r in results}):
            one = [r for r in results if r["seed"] == seed]
            a = _gaps(one, "diloco_adamw", workers, "sync_adamw")
            m = _gaps(one, "diloco_muon", workers, "sync_muon")
            if a and m:
                ratio = f"{m[0] / a[0]:.2f}" if a[0] > 0 else "n/a (AdamW gap <= 0)"
                lines.append(f"| {workers} | {seed} | {a[0]:+.1%} | {m[0]:+.1%} | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=10000, help="data.num_samples (4/5 train)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rows", nargs="+", default=None, help="row names (default: all)")
    parser.add_argument("--append", action="store_true", help="add to the results in --out")
    parser.add_argument("--out", default=_OUT)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--setting", choices=list(SETTINGS), default="mnist1d")
    parser.add_argument("--global-batch", type=int, help="instead of the setting's (diagnostics)")
    args = parser.parse_args()
    global_batch, period = SETTINGS[args.setting][:2]
    global_batch = args.global_batch or global_batch
    default_out = _OUT if args.setting == "mnist1d" else f"{_OUT}_{args.setting}"
    args.out = default_out if args.out == _OUT else args.out
    if args.render:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        write(args.out, saved["commands"], saved["results"])
        return
    results, commands = [], []
    if args.append:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        results, commands = saved["results"], saved["commands"]
    given = [("steps", args.steps), ("seeds", args.seeds), ("workers", args.workers)]
    given = [("setting", args.setting)] * (args.setting != "mnist1d") + given
    given += [("samples", args.samples)] if args.samples != 10000 else []
    given += [("out", os.path.relpath(args.out, ROOT))] if args.out != default_out else []
    given += [("rows", args.rows)] if args.rows else []
    given += [("global-batch", args.global_batch)] if args.global_batch else []
    command = (
        "python experiments/workers/workers_study.py "
        + " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in given)
        + (" --append" if args.append else "")
    )
    commands.append(f"{command}  ({datetime.date.today()})")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for workers in args.workers:
                for name, row in rows(args.steps, period).items():
                    if args.rows is not None and name not in args.rows:
                        continue
                    run_dir = os.path.join(tmp, f"{name}_m{workers}_s{seed}")
                    args_one = (args.steps, args.samples, run_dir, args.setting, global_batch)
                    s = run_one(row, workers, seed, *args_one)
                    results.append({
                        "row": name, "workers": workers, "seed": seed,
                        "batch_per_worker": global_batch // workers, "setting": args.setting,
                        "samples": args.samples if args.setting == "mnist1d" else None,
                        "test_loss": s["test_loss"], "test_accuracy": s["test_accuracy"],
                        "train_loss": s["train_loss"],
                        "comm_rounds": s["comm_rounds"], "comm_bytes": s["comm_bytes"],
                        "steps": s["steps"], "wall_time_s": s["wall_time_s"],
                    })  # fmt: skip
                    print(json.dumps(results[-1]), flush=True)
                    write(args.out, commands, results)  # a partial study is kept as it grows


READING = "\n## Reading\n"


def write(out: str, commands: list[str], results: list[dict]) -> None:
    """The .json and the .md; a `## Reading` section already in the .md is kept."""
    with open(out + ".json", "w") as f:
        json.dump({"commands": commands, "results": results}, f, indent=1)
    reading = ""
    if os.path.exists(out + ".md"):
        with open(out + ".md") as f:
            text = f.read()
        reading = text[text.index(READING) :] if READING in text else ""
    if results and results[0].get("setting", "mnist1d") == "lm":
        what = "the Shakespeare LM, 215k parameters"
    else:
        samples = " and ".join(sorted({str(r.get("samples", 10000)) for r in results}))
        what = f"MNIST-1D, data.num_samples={samples}"
    with open(out + ".md", "w") as f:
        f.write(
            f"# DiLoCo against sync as the workers grow, AdamW and Muon inner steps ({what})\n\n"
            "Made by (2 shared CPU cores, virtual workers; the script's docstring gives the "
            f"setting; raw runs: {os.path.basename(out)}.json):\n\n"
            + "".join(f"    {c}\n" for c in commands)
            + "\n"
            + "\n".join(table(results))
            + "\n\n"
            "Muon DiLoCo's gap to `sync_muon` over AdamW DiLoCo's gap to `sync_adamw`, per seed:"
            "\n\n" + "\n".join(ratio_lines(results)) + "\n" + reading
        )


if __name__ == "__main__":
    main()

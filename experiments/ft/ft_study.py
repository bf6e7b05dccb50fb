"""Workers that die, on `make train`'s job: MNIST-1D, 4 workers, post-local SGD (300 synchronous
steps, then k = 16), 3000 steps, through `ft=torchft`.

Rows, side by side for each seed: the job without `ft=` (torch.distributed), the same job with
`ft=torchft` and no fault, one worker SIGKILLed at 30% of the steps and restarted (it heals from
a live peer at the next sync), and one worker SIGKILLed at 30% with no restart left
(`ft.max_restarts=0`: lost for good, the other 3 finish). Reports the final test accuracy, the
wall time relative to the run without `ft=` of the same seed (measured one after the other in
this invocation), the participants and the samples lost: (steps the dead worker did not train)
x batch size, the steps read from the healed worker's own line (`ft: worker 1 healed ...; it
trains on from step S`). Writes experiments/ft/ft_study.{md,json}.

    python experiments/ft/ft_study.py              # 2 seeds x 4 rows, ~8 min on 2 cores
    python experiments/ft/ft_study.py --tiny       # smoke test: a few hundred steps
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
VICTIM = 1
ROWS = {  # name: (overrides, kill)
    "no ft (torch.distributed)": ([], False),
    "ft=torchft, no fault": (["ft=torchft"], False),
    "ft, worker killed at 30%, restarted": (["ft=torchft"], True),
    "ft, worker killed at 30%, lost for good": (
        ["ft=torchft", "ft.max_restarts=0", "ft.min_replicas={survivors}"],
        True,
    ),
}
HEALED = re.compile(r"ft: worker (\d+) healed from a live peer; it trains on from step (\d+)")


def run_one(name: str, seed: int, args, run_dir: str) -> dict:
    overrides, kill = ROWS[name]
    kill_step = int(args.steps * 0.3)
    cmd = [
        sys.executable,
        "-m",
        "localsgd.train",
        "+experiment=post_local_sgd",
        *(o.format(survivors=args.workers - 1) for o in overrides),
        f"dist.world_size={args.workers}",
        f"trainer.max_steps={args.steps}",
        f"sync.warmup_steps={args.warmup}",
        "trainer.checkpoint_every=0",
        "trainer.progress=false",
        "logger=jsonl",
        f"seed={seed}",
        f"hydra.run.dir={run_dir}",
    ]
    if kill:
        once = os.path.join(run_dir + ".once")
        spec = f"kill:{VICTIM}:{kill_step}:{once}"
        cmd.append(f"trainer.callbacks=[{{_target_:tests.faults.Fault,spec:'{spec}'}}]")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    batch = 32  # the preset's trainer.batch_size
    lost_steps = 0
    if kill:
        healed = HEALED.search(proc.stderr)
        resumed_at = int(healed.group(2)) if healed else args.steps
        lost_steps = resumed_at - kill_step
    return {
        "row": name,
        "seed": seed,
        "test_accuracy": summary["test_accuracy"],
        "command_wall_s": round(wall, 2),
        "train_wall_s": summary["wall_time_s"],
        "participants_end": summary.get("participants"),
        "participants_min": summary.get("participants_min"),
        "heals": summary.get("heals"),
        "failed_syncs": summary.get("failed_syncs"),
        "samples_lost": lost_steps * batch,
        "samples_total": args.steps * batch * args.workers,
        "comm_rounds": summary["comm_rounds"],
    }


def write_report(results: list[dict], args, elapsed: float, out: str) -> None:
    base = {r["seed"]: r["command_wall_s"] for r in results if r["row"].startswith("no ft")}
    lines = [
        "# Workers that die: `make train`'s job through torchft",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"`python experiments/ft/ft_study.py{' --tiny' if args.tiny else ''}`, {elapsed:.0f} s on "
        f"{os.cpu_count()} CPUs: MNIST-1D, the CNN, {args.workers} workers, {args.steps} steps "
        f"({args.warmup} synchronous, then k = 16), worker {VICTIM} SIGKILLed at step "
        f"{int(args.steps * 0.3)}. Wall time is the whole command's (start-up included), as a "
        "ratio to the run without `ft=` of the same seed, measured one after the other.",
        "",
        "| row | seed | test accuracy | wall vs no ft | participants (min / end) | heals | "
        "samples lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["command_wall_s"] / base[r["seed"]]
        parts = (
            "-"
            if r["participants_min"] is None
            else (f"{r['participants_min']} / {r['participants_end']}")
        )
        share = r["samples_lost"] / r["samples_total"]
        lost = f"{r['samples_lost']} of {r['samples_total']} ({share:.1%})"
        lines.append(
            f"| {r['row']} | {r['seed']} | {r['test_accuracy']:.4f} | {ratio:.2f}x | {parts} | "
            f"{'-' if r['heals'] is None else r['heals']} | {lost} |"
        )
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=os.path.join(HERE, "ft_study"))
    args = parser.parse_args()
    args.workers, args.steps, args.warmup = (3, 300, 30) if args.tiny else (4, 3000, 300)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for i, name in enumerate(ROWS):
                run_dir = os.path.join(tmp, f"s{seed}-{i}")
                results.append(run_one(name, seed, args, run_dir))
                print(json.dumps(results[-1]), flush=True)
    write_report(results, args, time.perf_counter() - started, args.out)
    with open(args.out + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    main()

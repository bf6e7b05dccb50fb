"""Does the plan's choice at 0.2 Gbit/s train as well as the best of the grid? (issue 51, target 2)

For each job, the plan (`python -m localsgd.plan JOB --bandwidth-gbps 0.2 --latency-ms 50`) picks
its setting; then the 12 settings of the utilisation check (check.py's SETTINGS) and the chosen
one, if it is not among them, train to the end on seeds 0 and 1. The target: the chosen setting
ends within 1% of the best final test loss of the 12, with no more bytes than that best, on both
seeds. The runs train without `comm.simulate`: the simulated link only sleeps after each real
collective (`localsgd/averaging/comm.py`), so what a run learns and sends is the same at any
simulated bandwidth; the check's 12th setting (a modelled slow worker) trains exactly as DiLoCo
H=16 does (no time budget: every worker computes every step), so it is not trained twice.

Jobs:
- MNIST-1D: the k-sweep's job (experiments/ksweep/README.md: SGD with momentum 0.9, lr 0.1,
  4 workers, batch 32, 1000 steps) with a third hidden layer (MLP 256-256-256, as
  `+experiment=streaming_diloco` has) so that 4 fragments exist for the streaming rows;
- the Shakespeare LM: the LM study's job (experiments/lm_shakespeare/study.py) at 2 workers.

    python experiments/plan_check/trained.py            # both jobs, ~1 h on 2 shared cores
    python experiments/plan_check/trained.py --report   # the .md again from the .json
    python experiments/plan_check/trained.py --jobs MNIST-1D --fresh   # plan and train one job
                                                        # afresh, keeping the other's results

Each job records the command, code and time its plan and runs were made with (`made`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import load_average, machine  # noqa: E402
from experiments.plan_check.check import SETTINGS  # noqa: E402
from localsgd.planner.grid import BY_KEY  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = (0, 1)
LINK = ["--bandwidth-gbps", "0.2", "--latency-ms", "50"]
QUIET = [
    "trainer.progress=false",
    "trainer.checkpoint_every=0",
    "logger=jsonl",
    "logger.plots=false",
]
JOBS = {
    "MNIST-1D": {
        "overrides": [
            "data=mnist1d",
            "model=mlp",
            "model.hidden=[256,256,256]",
            "dist.world_size=4",
            "trainer.max_steps=1000",
            "trainer.eval_every=100",
        ],
        "steps": 1000,
    },
    "Shakespeare LM": {
        "overrides": [
            "data=shakespeare",
            "model=transformer",
            "model.n_layers=4",
            "model.n_heads=4",
            "model.d_model=64",
            "optim=adamw",
            "optim.lr=0.002",
            "lr_schedule.warmup_steps=100",
            "dist.world_size=2",
            "trainer.max_steps=2000",
            "trainer.batch_size=16",
            "trainer.eval_every=1000",
            "trainer.eval_samples=1024",
            "trainer.eval_batch_size=256",
            "trainer.sample_chars=0",
        ],
        "steps": 2000,
    },
}
TARGET = 0.01  # within 1% of the best final loss


def settings() -> list[tuple[str, str]]:
    """(name, grid key) of the check's settings that train differently."""
    out, seen = [], set()
    for name, key, extra in SETTINGS:
        if key in seen or extra:  # extra: only the workers' pace differs (see the doc)
            continue
        seen.add(key)
        out.append((name, key))
    return out


def run_plan(job: dict, out: str) -> dict:
    path = os.path.join(out, "plan.json")
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.plan", *job["overrides"], *LINK, "--json", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the plan failed:\n{proc.stderr[-3000:]}")
    print(proc.stdout, flush=True)
    with open(path) as f:
        plan = json.load(f)
    plan["stdout"] = proc.stdout
    return plan


def train(overrides: list[str], run_dir: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def commit() -> str:
    """The code the runs are made with: HEAD, and whether localsgd/ differs from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "localsgd"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return head + (" (localsgd/ modified)" if dirty else "")


def meets(job: dict, key: str, seed: str) -> tuple[str, float, float, bool]:
    """The grid's best on `seed`, `key`'s loss gap and bytes ratio to it, and whether `key`
    meets the target there."""
    runs = {k: r[seed] for k, r in job["runs"].items() if k in job["grid"]}
    best = min(runs, key=lambda k: runs[k]["test_loss"])
    mine = job["runs"][key][seed]
    gap = mine["test_loss"] / runs[best]["test_loss"] - 1
    ratio = mine["comm_bytes"] / runs[best]["comm_bytes"]
    return best, gap, ratio, gap <= TARGET and ratio <= 1


def judge(results: dict) -> None:
    for job in results["jobs"].values():
        job["verdicts"] = []
        for seed in map(str, SEEDS):
            best, gap, ratio, held = meets(job, job["chosen"], seed)
            job["verdicts"].append(
                {"seed": int(seed), "best": best, "gap": gap, "bytes_ratio": ratio, "held": held}
            )
        # which fixed choice of the trained rows would have met the target on every seed
        job["would_hold"] = [
            key for key in job["runs"] if all(meets(job, key, str(s))[3] for s in SEEDS)
        ]


def render(results: dict) -> str:
    lines = [
        "# The plan's choice at 0.2 Gbit/s against the grid's best final loss (issue 51)",
        "",
        f"- last command: `{results['command']}` (each job says what made its rows)",
        f"- it started {results['started']}; {results['total_s']:.0f} s in all",
        f"- machine: {results['machine']}; load at start {results['load_start']}, at end "
        f"{results['load_end']}",
        "- every run trained without `comm.simulate` (the link only sleeps; the values and "
        "bytes are the same at any simulated bandwidth); final test loss of the averaged model "
        "(MNIST-1D: its 2000 test samples; the LM: the whole validation split, nats per "
        "character); bytes: one worker's, the final average included",
        "",
    ]
    for name in sorted(results["jobs"], key=lambda n: list(JOBS).index(n)):
        job = results["jobs"][name]
        chosen = job["chosen"]
        made = job.get("made")
        lines += [f"## {name}", ""]
        if made:
            lines += [
                f"Planned and trained by `{made['command']}` at {made['commit']}, started "
                f"{made['started']}"
                + (f", {made['seconds']:.0f} s." if "seconds" in made else "."),
                "",
            ]
        lines += [
            f"Job: `{' '.join(job['overrides'])}`. The plan at 0.2 Gbit/s, 50 ms "
            f"(`python -m localsgd.plan JOB {' '.join(LINK)}`): chosen "
            f"**{BY_KEY[chosen].label}** (it "
            + ("reaches" if job["plan"]["meets_target"] else "does not reach")
            + " utilisation 0.95 by its prediction).",
            "",
            "| setting | "
            + " | ".join(f"test loss, seed {s}" for s in SEEDS)
            + " | bytes per worker | predicted utilisation at 0.2 Gbit/s | backed by the studies |",
            "|---|" + "---:|" * len(SEEDS) + "---:|---:|---|",
        ]
        rows = {r["key"]: r for r in job["plan"]["rows"]}
        for key, runs in job["runs"].items():
            mark = " (chosen)" if key == chosen else ""
            util = rows[key]["utilisation"]
            losses = " | ".join(f"{runs[str(s)]['test_loss']:.4f}" for s in SEEDS)
            lines.append(
                f"| {BY_KEY[key].label}{mark} | {losses} | {runs['0']['comm_bytes']:,} | "
                f"{'-' if util is None else f'{util:.3f}'} | "
                f"{'yes' if rows[key]['backed'] else 'no'} |"
            )
        lines.append("")
        for v in job["verdicts"]:
            lines.append(
                f"- seed {v['seed']}: best of the grid {BY_KEY[v['best']].label}; the chosen "
                f"setting {v['gap'] * 100:+.2f}% against it, with {v['bytes_ratio']:.3g}x its "
                f"bytes: **{'held' if v['held'] else 'not held'}**"
            )
        lines.append(
            "- the trained settings that would have held on every seed: "
            + ("; ".join(BY_KEY[k].label for k in job["would_hold"]) or "none")
        )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS))
    parser.add_argument("--report", action="store_true")
    parser.add_argument(
        "--fresh", action="store_true", help="drop the named jobs' saved plan and runs first"
    )
    args = parser.parse_args(argv)
    json_path = os.path.join(args.out, "trained.json")
    if args.report:
        with open(json_path) as f:
            results = json.load(f)
        judge(results)
        text = render(results)
        with open(os.path.join(args.out, "trained.md"), "w") as f:
            f.write(text)
        print(text)
        return results
    shown = sys.argv[1:] if argv is None else argv
    t0 = time.perf_counter()
    results = {
        "command": " ".join(["python experiments/plan_check/trained.py", *shown]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_start": load_average(),
        "jobs": {},
    }
    if os.path.exists(json_path):  # a partial run: keep what it trained
        with open(json_path) as f:
            results["jobs"] = json.load(f).get("jobs", {})
    with tempfile.TemporaryDirectory(prefix="plan-trained-") as tmp:
        for name in args.jobs:
            spec = JOBS[name]
            if args.fresh:
                results["jobs"].pop(name, None)
            job = results["jobs"].setdefault(name, {"overrides": spec["overrides"], "runs": {}})
            if "plan" not in job:
                job["plan"] = run_plan(spec, tmp)
                job["made"] = {
                    "command": results["command"],
                    "commit": commit(),
                    "started": results["started"],
                }
            job_t0 = time.perf_counter()
            chosen = job["plan"]["chosen"]
            job["chosen"] = chosen
            job["grid"] = [key for _, key in settings()]
            keys = job["grid"] + ([chosen] if chosen not in job["grid"] else [])
            for key in keys:
                for seed in SEEDS:
                    if str(seed) in job["runs"].get(key, {}):
                        continue
                    overrides = [
                        *spec["overrides"],
                        *QUIET,
                        *BY_KEY[key].overrides(spec["steps"]),
                        f"seed={seed}",
                    ]
                    run_dir = os.path.join(tmp, f"{name}-{key}-{seed}".replace(" ", "_"))
                    began = time.perf_counter()
                    summary = train(overrides, run_dir)
                    job["runs"].setdefault(key, {})[str(seed)] = {
                        "test_loss": summary["test_loss"],
                        "test_accuracy": summary.get("test_accuracy"),
                        "comm_bytes": summary["comm_bytes"],
                        "comm_rounds": summary["comm_rounds"],
                        "overrides": overrides,
                    }
                    print(
                        f"{name} {key} seed {seed}: test loss {summary['test_loss']:.4f}, "
                        f"{summary['comm_bytes']:,} bytes, {time.perf_counter() - began:.0f} s",
                        flush=True,
                    )
                    with open(json_path, "w") as f:  # after every run: a stop loses one
                        json.dump(results, f, indent=1)
            made = job.setdefault("made", {})
            made["seconds"] = made.get("seconds", 0) + time.perf_counter() - job_t0
    results["total_s"] = time.perf_counter() - t0
    results["load_end"] = load_average()
    judge(results)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    text = render(results)
    with open(os.path.join(args.out, "trained.md"), "w") as f:
        f.write(text)
    print(text)
    return results


if __name__ == "__main__":
    main()

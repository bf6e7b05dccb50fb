"""The planner's utilisation model against measurement (issue 51, item 3): 12 settings x 4 links.

Each cell is a real run, `python -m localsgd.train`, of a short LM job (the communication
frontier's: a 4-block character-level GPT, d_model 64, 2 workers, inner AdamW, batch 16 x 64
characters, STEPS steps, seed 0) on a simulated link (`comm.simulate`) of 0.05, 0.2, 1 or 5 Gbit/s,
each with 50 ms latency per collective. The 12 settings were chosen and written here before any
cell ran: the issue's eight (plain H=16; DiLoCo H=16 and H=64; Streaming DiLoCo H=16 P=4 at
τ=1 and τ=4; 4 bits; top-k; DDP-like period 1) and four more, each testing one term of the
model that the eight leave thin:

- DiLoCo H=16 in bf16: the fourth wire the plan offers, an all-reduce of half the bytes;
- Streaming DiLoCo H=16 P=4 τ=0: P blocking collectives a round, each paying the latency;
- plain averaging H=16 with `sync.overlap` (τ=1 on the whole model): an overlap far shorter
  than the link's time, so the max(0, S - τc) term is taken in its middle;
- DiLoCo H=16 with worker 1 1.5x slower (`comm.simulate.worker_speed=[1,1.5]`, step_s 60 ms):
  the barrier term, rank 0 waiting H (c_1 - c_0) a round for the slow worker.

Per cell, measured utilisation = rank 0's compute seconds over its training loop's seconds,
both from the run itself (`Trainer.compute_s`, written by the `StepClock` callback at the last
step). Predicted = `localsgd.planner.model.predict_run` of the setting's schedule (its bytes
from the model's shape, exactly as the averagers count them), the link (the simulated one's
bandwidth and latency, as given), and each worker's step time measured in that same run
(compute seconds / steps): the step time is an input, measured under the load the run saw;
nothing is fitted. A second prediction uses the step time the plan's own probe measured once
per link, before that link's cells (`--` the machine's load moves between the two).

    python experiments/plan_check/check.py             # 48 cells, ~15-25 min on 2 cores
    python experiments/plan_check/check.py --report    # the .md and .png again from the .json
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
from localsgd.planner.grid import BY_KEY, Setting  # noqa: E402
from localsgd.planner.model import Link, predict_run, sync_steps  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LATENCY_MS = 50.0
BANDWIDTHS = (0.05, 0.2, 1.0, 5.0)  # Gbit/s
STEPS = 128
WORKERS = 2
SLOW = ["comm.simulate.worker_speed=[1,1.5]", "comm.simulate.step_s=0.06"]
# (cell name, grid setting, extra overrides): fixed before any run (see the module doc)
SETTINGS = (
    ("plain H=16", "plain-h16", []),
    ("DiLoCo H=16", "diloco-h16", []),
    ("DiLoCo H=64", "diloco-h64", []),
    ("streaming P=4 τ=1", "stream-h16-p4-t1", []),
    ("streaming P=4 τ=4", "stream-h16-p4-t4", []),
    ("DiLoCo H=16 4-bit", "diloco-h16-int4", []),
    ("DiLoCo H=16 top-k", "topk-h16", []),
    ("DDP-like", "ddp", []),
    ("DiLoCo H=16 bf16", "diloco-h16-bf16", []),
    ("streaming P=4 τ=0", "stream-h16-p4-t0", []),
    ("plain H=16 overlap", "plain-h16-overlap", []),
    ("DiLoCo H=16, worker 1 1.5x slow", "diloco-h16", SLOW),
)
TARGET_POINTS = 5.0  # |predicted - measured| <= 5 points of utilisation
TARGET_CELLS = 44


def corpus(tmp: str) -> str:
    """The first 600k characters of the Shakespeare corpus (`make data`): the cells need a
    short final evaluation, not the whole 5M-character validation split."""
    data_dir = os.environ.get("LOCALSGD_DATA_DIR", os.path.expanduser("~/.cache/localsgd"))
    source = os.path.join(data_dir, "shakespeare", "input.txt")
    if not os.path.isfile(source):
        raise SystemExit(f"{source} is missing: run `make data` first")
    path = os.path.join(tmp, "shakespeare_600k.txt")
    with open(source, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as g:
        g.write(f.read(600_000))
    return path


def job(text: str, steps: int) -> list[str]:
    return [
        "data=text",
        f"data.path={text}",
        "model=transformer",
        "model.n_layers=4",
        "model.d_model=64",
        "model.n_heads=4",
        "optim=adamw",
        "optim.lr=0.002",
        "lr_schedule.warmup_steps=20",
        f"dist.world_size={WORKERS}",
        f"trainer.max_steps={steps}",
        "trainer.batch_size=16",
        f"trainer.eval_every={steps + 1}",
        "trainer.eval_batch_size=256",
        f"trainer.log_every={steps}",
        "trainer.progress=false",
        "trainer.checkpoint_every=0",
        "trainer.track_drift=false",
        "trainer.sample_chars=0",
        "logger=jsonl",
        "logger.plots=false",
        "seed=0",
    ]


def simulate(gbps: float) -> list[str]:
    return [f"comm.simulate.bandwidth_gbps={gbps}", f"comm.simulate.latency_ms={LATENCY_MS}"]


def run_cell(overrides: list[str], run_dir: str) -> dict:
    clock = os.path.join(run_dir, "clock")
    cmd = [
        sys.executable,
        "-m",
        "localsgd.train",
        *overrides,
        f"trainer.callbacks=[{{_target_:localsgd.planner.measure.StepClock,out:'{clock}'}}]",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    ranks = []
    for r in range(WORKERS):
        with open(os.path.join(clock, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = [r for r in map(json.loads, f) if "loss" in r][-1]
    return {"ranks": ranks, "comm_bytes": last["comm_bytes"], "comm_rounds": last["comm_rounds"]}


def plan_step_times(overrides: list[str]) -> list[list[float]]:
    """Each worker's step times as the plan's own probe measures them (25 steps, the first 5
    untimed, communication off)."""
    from localsgd.planner.cli import compose, measure, measurement_config

    _, run_cfg, _ = compose(overrides)
    records = measure(measurement_config(run_cfg), WORKERS, 25, False)
    return [r["step_times"] for r in records]


def run_step_times(ranks: list[dict]) -> list[list[float]]:
    """Each worker's step times in the run itself (its compute seconds step by step, from
    `StepClock`), the first step (allocations, cold caches) left out."""
    out = []
    for r in ranks:
        trace = [0.0, *r["compute_trace"]]
        out.append([b - a for a, b in zip(trace[1:-1], trace[2:], strict=True)])
    return out


def predicted(setting: Setting, shape, gbps: float, samples, steps: int, jitter: bool) -> float:
    """Rank 0's utilisation by the model: with `jitter`, each step's time drawn from the
    worker's `samples` (the barrier's jitter); else every step at the worker's mean."""
    schedule = setting.schedule(shape)
    link = Link(LATENCY_MS / 1e3, gbps, simulated=True)
    means = [sum(s) / len(s) for s in samples]
    utilisation, _ = predict_run(
        schedule, link, means, steps, samples=samples if jitter else None, reps=200
    )
    return utilisation[0]


def expected_bytes(setting: Setting, shape, steps: int) -> int:
    """The bytes rank 0's counter holds after the loop: every sync launched in it."""
    schedule = setting.schedule(shape)
    return sum(schedule.fragment_bytes[p] for p, _, _ in sync_steps(schedule, steps))


def derive(results: dict) -> None:
    from localsgd.planner.sizes import ModelShape

    shape = ModelShape.from_dict(results["shape"])
    steps = results["steps"]
    for cell in results["cells"]:
        setting = BY_KEY[cell["setting"]]
        ranks = cell["ranks"]
        samples = run_step_times(ranks)
        cell["step_s"] = [sum(s) / len(s) for s in samples]
        cell["plan_step_s"] = [sum(s) / len(s) for s in cell["plan_step_times"]]
        cell["measured"] = ranks[0]["compute_s"] / ranks[0]["wall_s"]
        cell["predicted"] = predicted(setting, shape, cell["gbps"], samples, steps, True)
        cell["predicted_mean"] = predicted(setting, shape, cell["gbps"], samples, steps, False)
        cell["predicted_plan"] = predicted(
            setting, shape, cell["gbps"], cell["plan_step_times"], steps, True
        )
        cell["error_points"] = 100 * (cell["predicted"] - cell["measured"])
        cell["bytes_expected"] = expected_bytes(setting, shape, steps)
    errors = [abs(c["error_points"]) for c in results["cells"]]
    results["within"] = sum(e <= TARGET_POINTS for e in errors)
    for key in ("mean", "plan"):
        results[f"within_{key}"] = sum(
            abs(100 * (c[f"predicted_{key}"] - c["measured"])) <= TARGET_POINTS
            for c in results["cells"]
        )
    results["bytes_exact"] = sum(c["bytes_expected"] == c["comm_bytes"] for c in results["cells"])


def render(results: dict) -> str:
    cells = results["cells"]
    names = list(dict.fromkeys(c["name"] for c in cells))
    links = sorted({c["gbps"] for c in cells})
    lines = [
        "# The planner's utilisation model against measurement (issue 51)",
        "",
        f"- command: `{results['command']}`",
        f"- started: {results['started']}; {results['total_s']:.0f} s in all",
        f"- machine: {results['machine']}",
        f"- load average (1/5/15 min) at start: {results['load_start']}; at end: "
        f"{results['load_end']}",
        f"- job: {results['job_text']}; {results['shape']['params']:,} parameters; "
        f"{results['steps']} steps; links of {', '.join(f'{g:g}' for g in links)} Gbit/s, "
        f"each with {LATENCY_MS:g} ms latency per collective (`comm.simulate`)",
        f"- **{results['within']} of {len(cells)} cells within ±{TARGET_POINTS:g} points** "
        f"(target: >= {TARGET_CELLS} of 48), predicted with each worker's step times measured "
        f"in the run itself; {results['within_mean']} of {len(cells)} with every step at the "
        f"worker's mean (no jitter); {results['within_plan']} of {len(cells)} with the step "
        f"times the plan's probe measured before each link's cells (communication off); rank "
        f"0's bytes as predicted, exactly, in {results['bytes_exact']} of {len(cells)}",
        "",
        "Each cell: utilisation **predicted** (the model, each step's time drawn from the run's "
        "own step times: the barrier's jitter) / **measured** (rank 0's compute seconds over its "
        "training loop's seconds) / predicted with every step at its mean / predicted from the "
        "plan probe's step times. **x**: the first two more than 5 points apart.",
        "",
        "| setting | " + " | ".join(f"{g:g} Gbit/s" for g in links) + " |",
        "|---|" + "---:|" * len(links),
    ]
    for name in names:
        row = []
        for g in links:
            c = next(c for c in cells if c["name"] == name and c["gbps"] == g)
            mark = "" if abs(c["error_points"]) <= TARGET_POINTS else " **x**"
            row.append(
                f"**{c['predicted']:.3f}** / **{c['measured']:.3f}** / "
                f"{c['predicted_mean']:.3f} / {c['predicted_plan']:.3f}{mark}"
            )
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Per cell: step times (ms, rank 0 / rank 1, measured in the run; the plan probe's), "
        "rank 0's loop and compute seconds, its seconds inside collectives, and bytes:",
        "",
        "| setting | Gbit/s | step ms (run) | step ms (plan) | loop s | compute s | comm s "
        "| bytes (counted / predicted) | error (points) | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        r0 = c["ranks"][0]
        lines.append(
            f"| {c['name']} | {c['gbps']:g} | "
            + " / ".join(f"{s * 1e3:.1f}" for s in c["step_s"])
            + " | "
            + " / ".join(f"{s * 1e3:.1f}" for s in c["plan_step_s"])
            + f" | {r0['wall_s']:.2f} | {r0['compute_s']:.2f} | {r0['comm_s']:.2f} | "
            f"{c['comm_bytes']:,} / {c['bytes_expected']:,} | {c['error_points']:+.1f} | "
            f"{c['load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    links = sorted({c["gbps"] for c in cells})
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    ax.fill_between([0, 1.05], [-0.05, 1.0], [0.05, 1.10], color="0.9", label="±5 points")
    ax.plot([0, 1.05], [0, 1.05], color="0.5", linewidth=1)
    for i, g in enumerate(links):
        mine = [c for c in cells if c["gbps"] == g]
        ax.scatter(
            [c["measured"] for c in mine],
            [c["predicted"] for c in mine],
            color=f"C{i}",
            s=22,
            label=f"{g:g} Gbit/s, 50 ms",
        )
        ax.scatter(
            [c["measured"] for c in mine],
            [c["predicted_mean"] for c in mine],
            facecolors="none",
            edgecolors=f"C{i}",
            s=22,
            linewidths=0.8,
        )
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("measured utilisation (rank 0: compute s / loop s)")
    ax.set_ylabel("predicted utilisation (localsgd.planner.model)")
    ax.set_title(
        f"{results['within']} of {len(cells)} cells within ±5 points (12 settings x "
        f"{len(links)} links)\nfilled: step times drawn from the run's own; hollow: every step "
        "at its mean",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_outputs(results: dict, out: str) -> None:
    text = render(results)
    with open(os.path.join(out, "plan_check.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(out, "plan_check.png"))
    print(text, end="")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--links", type=float, nargs="+", default=list(BANDWIDTHS))
    parser.add_argument("--only", nargs="+", default=None, help="these cell names only (a trial)")
    parser.add_argument("--report", action="store_true", help="redo .md/.png from the .json")
    args = parser.parse_args(argv)
    json_path = os.path.join(args.out, "plan_check.json")
    if args.report:
        with open(json_path) as f:
            results = json.load(f)
        derive(results)
        write_outputs(results, args.out)
        return results
    from localsgd.planner.cli import compose
    from localsgd.planner.sizes import shape_of

    shown = sys.argv[1:] if argv is None else argv
    t0 = time.perf_counter()
    results: dict = {
        "command": " ".join(["python experiments/plan_check/check.py", *shown]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_start": load_average(),
        "steps": args.steps,
        "cells": [],
    }
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        text = corpus(tmp)
        results["job_text"] = "the first 600,000 characters of Shakespeare (`make data`)"
        base = job(text, args.steps)
        _, run_cfg, _ = compose(base)
        results["shape"] = shape_of(run_cfg).to_dict()
        n = 0
        for gbps in args.links:
            plan_times = plan_step_times(base)
            print(
                f"{gbps:g} Gbit/s: the plan's probe measured "
                + " / ".join(f"{sum(s) / len(s) * 1e3:.1f}" for s in plan_times)
                + " ms a step",
                flush=True,
            )
            for name, key, extra in SETTINGS:
                if args.only and name not in args.only:
                    continue
                n += 1
                setting = BY_KEY[key]
                overrides = [*base, *setting.overrides(args.steps), *simulate(gbps), *extra]
                load = os.getloadavg()[0]
                cell = run_cell(overrides, os.path.join(tmp, f"cell{n}"))
                # the plan measures the modelled slow worker too
                plan = plan_step_times([*base, *extra]) if extra else plan_times
                cell.update(
                    name=name,
                    setting=key,
                    gbps=gbps,
                    load=load,
                    plan_step_times=plan,
                    overrides=overrides,
                )
                results["cells"].append(cell)
                r0 = cell["ranks"][0]
                print(
                    f"{gbps:g} Gbit/s {name}: loop {r0['wall_s']:.2f} s, compute "
                    f"{r0['compute_s']:.2f} s, utilisation {r0['compute_s'] / r0['wall_s']:.3f}",
                    flush=True,
                )
    results["total_s"] = time.perf_counter() - t0
    results["load_end"] = load_average()
    derive(results)
    os.makedirs(args.out, exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    write_outputs(results, args.out)
    return results


if __name__ == "__main__":
    main()

"""The communication frontier (issue 20, item 7): the LM job's compute utilisation against the link.

Each run is `python -m localsgd.train` (2 CPU workers, the character-level transformer of
experiments/lm_shakespeare at 4 blocks, inner AdamW) on a simulated link of 1 Gbit/s or
100 Mbit/s, both with 100 ms latency per collective (`comm.simulate`). Rows: DDP (gradient
all-reduce every step: `sync.warmup_steps` = all the steps), DiLoCo H=64, Streaming DiLoCo P=4
(a fragment every 16 steps) at tau = 0, 1, 2, 4 (`sync.delay_steps`, alpha 0.5), and streaming at
tau = 1 and 4 sending 4 bits (`sync.comm_dtype=float4_e2m1`, error feedback).
Beside them, in the same invocation, the same job with `comm.disabled=true` (no collective at
all) runs right before each row: its training-loop wall time is the compute that row is measured
against (the machine may be shared: the pair sees the same load, as far as load holds still).

Per row, all from the run's own `metrics.jsonl` (logged every step, so the per-step byte counter
gives each sync's size) up to the last step, i.e. the training loop without the final average:

- utilisation, measured: the paired compute-only run's loop wall / the row's loop wall.
  Everything the row does beyond plain training counts against it: the link's exposed time, the
  outer step, quantisation, waiting for the other worker, and any change in the machine's load
  between the two runs.
- utilisation, timers: 1 - comm_seconds / loop wall, rank 0's own clock inside the collectives
  (with tau > 0 only the wait at the merge: the exposed part).
- utilisation, model (labelled so): steps*c / (steps*c + sum over syncs of
  max(0, latency + bytes/bandwidth - tau*c)), c the seconds per step of the row's paired
  compute-only run (the plot's curves: the fastest of them); the plot draws
  it over 10 Mbit/s-100 Gbit/s, the measured points on top (Streaming DiLoCo's figure 4).

Writes FRONTIER.md, frontier.png and frontier.json into --out (default experiments/bench).

    python experiments/bench/frontier.py           # 32 runs, ~11-13 min on 2 cores
    python experiments/bench/frontier.py --tiny    # toy size, one link, one baseline: a test
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import load_average, machine  # noqa: E402

LATENCY_MS = 100.0
LINKS = {"1 Gbit/s": 1.0, "100 Mbit/s": 0.1}  # name: bandwidth_gbps, both at LATENCY_MS
FULL = {
    "steps": 256,
    "period": 64,
    "fragments": 4,
    "links": ["1 Gbit/s", "100 Mbit/s"],
    "model": ["model.n_layers=4", "model.d_model=64", "model.n_heads=4"],
    "batch": 16,
    "paired": True,  # a compute-only run right before every row
}
TINY = {
    "steps": 32,
    "period": 16,
    "fragments": 4,
    "links": ["100 Mbit/s"],
    "model": ["model.n_layers=4", "model.d_model=16", "model.n_heads=2"],
    "batch": 4,
    "paired": False,  # one compute-only run, first
}
FOUR_BIT = ["sync.comm_dtype=float4_e2m1", "sync.error_feedback=true"]


def rows(p: dict) -> dict[str, tuple[list[str], int]]:
    """Row name: (overrides, tau)."""
    h, frags = p["period"], p["fragments"]
    streaming = ["sync=streaming_diloco", f"sync.period={h}", f"sync.fragments={frags}"]
    out = {
        "DDP": ([f"sync.warmup_steps={p['steps']}", "sync.period=1"], 0),
        f"DiLoCo H={h}": (["sync=diloco", f"sync.period={h}", "sync.outer_warmup_rounds=0"], 0),
    }
    # tau = 4: a fragment's sync on the slow link (latency + bytes) outlasts 2 steps of this small
    # model; the paper's robust range is tau < 5, and tau must stay below H / P
    taus = [tau for tau in (0, 1, 2, 4) if tau < h // frags]
    for tau in taus:
        out[f"streaming P={frags} tau={tau}"] = ([*streaming, f"sync.delay_steps={tau}"], tau)
    for tau in (1, 4) if 4 in taus else (1,):
        out[f"streaming P={frags} tau={tau} 4-bit"] = (
            [*streaming, f"sync.delay_steps={tau}", *FOUR_BIT],
            tau,
        )
    return out


def corpus(tmp: str, tiny: bool = False) -> tuple[str, str]:
    """(path, description) of the text: the Shakespeare corpus if `make data` built it (not for
    `--tiny`, whose input must not depend on the machine), else the Python documentation topics
    shipped with the standard library (offline, ~465k characters)."""
    data_dir = os.environ.get("LOCALSGD_DATA_DIR", os.path.expanduser("~/.cache/localsgd"))
    shakespeare = os.path.join(data_dir, "shakespeare", "input.txt")
    if os.path.isfile(shakespeare) and not tiny:
        return shakespeare, "character-level Shakespeare (`make data`)"
    import pydoc_data.topics

    path = os.path.join(tmp, "corpus.txt")
    topics = pydoc_data.topics.topics
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(topics[k] for k in sorted(topics)))
    size = os.path.getsize(path)
    return path, (
        f"the Python {sys.version_info.major}.{sys.version_info.minor} documentation topics "
        f"(`pydoc_data.topics`, {size / 1e3:.0f} kB; the Shakespeare corpus was not built)"
    )


def job(p: dict, text: str) -> list[str]:
    return [
        "data=text",
        f"data.path={text}",
        "model=transformer",
        *p["model"],
        "optim=adamw",
        "optim.lr=0.002",
        "lr_schedule.warmup_steps=20",
        "dist.world_size=2",
        f"trainer.max_steps={p['steps']}",
        f"trainer.batch_size={p['batch']}",
        f"trainer.eval_every={p['steps'] + 1}",  # only the final evaluation, after the loop
        "trainer.eval_batch_size=256",
        "trainer.log_every=1",  # the per-step byte counter: each sync's size
        "trainer.progress=false",
        "trainer.checkpoint_every=0",
        "trainer.track_drift=false",
        "trainer.sample_chars=0",
        "logger=jsonl",
        "seed=0",
    ]


def run_one(overrides: list[str], run_dir: str, name: str) -> dict:
    for attempt in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-m", "localsgd.train", *overrides, f"hydra.run.dir={run_dir}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode == 0:
            break
        error = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        print(f"run {name}, try {attempt}, failed: {error[0]}", flush=True)
        if attempt == 2:
            raise SystemExit(f"run {name} failed twice:\n{proc.stderr[-3000:]}")
        run_dir += "-retry"  # a fresh directory: the CLI refuses to reuse a finished one
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logs = [r for r in map(json.loads, f) if "loss" in r]
    last = logs[-1]
    assert last["step"] == summary["steps"], (name, last["step"], summary["steps"])
    syncs, before = [], 0
    for r in logs:  # the cumulative byte counter, step by step: each step's bytes
        if r["comm_bytes"] > before:
            syncs.append(r["comm_bytes"] - before)
        before = r["comm_bytes"]
    return {
        "wall_s": last["wall_time_s"],  # training loop, rank 0, up to the last step's log line
        "comm_s": last["comm_seconds"],
        "comm_bytes": last["comm_bytes"],
        "comm_rounds": last["comm_rounds"],
        "sync_bytes": syncs,  # bytes of each step that sent any
        "steps": summary["steps"],
        "params": summary["params"],
        "test_loss": summary["test_loss"],
        "final_comm_bytes": summary["comm_bytes"],  # with the final average
    }


def link_seconds(nbytes: int, gbps: float) -> float:
    return LATENCY_MS / 1e3 + nbytes * 8 / (gbps * 1e9)


def model_utilisation(run: dict, tau: int, gbps: float, step_s: float) -> float:
    compute = run["steps"] * step_s
    exposed = sum(max(0.0, link_seconds(b, gbps) - tau * step_s) for b in run["sync_bytes"])
    return compute / (compute + exposed)


def derive(results: dict) -> None:
    """Add the utilisation figures to every row, in place."""
    compute_s = statistics.median(r["wall_s"] for r in results["baseline"])
    results["compute_s"] = compute_s
    dil = next(v for k, v in results["rows"][results["links"][0]].items() if k.startswith("DiLoCo"))
    for link in results["links"]:
        gbps = LINKS[link]
        for run in results["rows"][link].values():
            step_s = run["compute_wall_s"] / run["steps"]  # c under the row's own paired load
            run["util_measured"] = run["compute_wall_s"] / run["wall_s"]
            run["util_timers"] = 1 - run["comm_s"] / run["wall_s"]
            run["util_model"] = model_utilisation(run, run["tau"], gbps, step_s)
            run["link_s"] = sum(link_seconds(b, gbps) for b in run["sync_bytes"])
            run["bytes_vs_diloco"] = run["comm_bytes"] / dil["comm_bytes"]
            run["peak_vs_diloco"] = max(run["sync_bytes"]) / max(dil["sync_bytes"])


def render(results: dict, command: str) -> str:
    walls = [r["wall_s"] for r in results["baseline"]]
    when = "right before each row" if results["p"]["paired"] else "once, first"
    first = next(iter(results["rows"][results["links"][0]].values()))
    lines = [
        "# The communication frontier: utilisation against the link (issue 20, item 7)",
        "",
        f"- command: `{command}`",
        f"- started: {results['started']}; whole benchmark: {results['total_s']:.0f} s",
        f"- machine: {results['machine']}",
        f"- load average (1/5/15 min) at start: {results['load_start']}; at end: "
        f"{results['load_end']} (other jobs shared the cores when this is above the core count)",
        f"- job: {results['corpus']}; transformer ({', '.join(results['p']['model'])}, "
        f"{first['params']} parameters, {first['params'] * 4 / 1e6:.2f} MB in fp32), 2 workers, "
        f"batch {results['p']['batch']} x 64 characters each, AdamW lr 0.002, "
        f"{results['p']['steps']} steps, seed 0; links with {LATENCY_MS:.0f} ms latency per "
        "collective (`comm.simulate`)",
        f"- compute only (`comm.disabled=true`, the same job without any collective, {when}): "
        f"loop wall {min(walls):.1f}-{max(walls):.1f} s over {len(walls)} run(s), median "
        f"{results['compute_s']:.2f} s ({results['compute_s'] / results['p']['steps'] * 1e3:.0f} "
        "ms a step: the model's c)",
        "",
        "Columns: bytes are one worker's, in the training loop (the final average excluded); peak "
        "= the most sent in one step; *link s* = what the simulated link charges for those syncs "
        "(latency + bytes / bandwidth each); *exposed s* = rank 0's timer inside the collectives "
        "(with tau > 0 only the wait at the merge); *compute wall s* = the paired compute-only "
        "run's loop wall; *load* = the 1-minute load average as the row started (2 cores); "
        "utilisation *measured* = compute wall / row wall, measured side by side in this "
        "invocation; *timers* = 1 - exposed / row wall (rank 0's clock, one run); *model* = the "
        "formula in the script (tau steps of compute hide each sync; c from the paired run), not a "
        "measurement.",
        "",
        "| link | row | syncs | MB sent | bytes/step kB | peak bytes/step kB | bytes vs DiLoCo "
        "| peak vs DiLoCo | link s | exposed s | compute wall s | row wall s | load "
        "| util. measured | util. timers | util. model | test loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link in results["links"]:
        for name, r in results["rows"][link].items():
            lines.append(
                f"| {link} | {name} | {len(r['sync_bytes'])} | {r['comm_bytes'] / 1e6:.2f} | "
                f"{r['comm_bytes'] / r['steps'] / 1e3:.2f} | {max(r['sync_bytes']) / 1e3:.1f} | "
                f"{r['bytes_vs_diloco']:.3f} | {r['peak_vs_diloco']:.3f} | {r['link_s']:.1f} | "
                f"{r['comm_s']:.1f} | {r['compute_wall_s']:.1f} | {r['wall_s']:.1f} | "
                f"{r['load']:.1f} | {r['util_measured']:.3f} | "
                f"{r['util_timers']:.3f} | {r['util_model']:.3f} | {r['test_loss']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    bandwidths = np.logspace(-2, 2, 60)
    link0 = results["links"][0]
    # the curves: the fastest compute-only run's step, the machine's speed under the least load
    step_s = min(r["wall_s"] for r in results["baseline"]) / results["p"]["steps"]
    top = 0.0
    for i, name in enumerate(results["rows"][link0]):
        color = f"C{i}"
        run = results["rows"][link0][name]
        model = [model_utilisation(run, run["tau"], b, step_s) for b in bandwidths]
        ax.plot(bandwidths, model, color=color, linestyle="--", linewidth=1)
        xs = [LINKS[link] for link in results["links"]]
        ys = [results["rows"][link][name]["util_measured"] for link in results["links"]]
        ax.plot(xs, ys, color=color, marker="o", linestyle="-", label=name)
        timers = [results["rows"][link][name]["util_timers"] for link in results["links"]]
        ax.plot(xs, timers, color=color, marker="o", markerfacecolor="none", linestyle="none")
        top = max(top, *ys)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth (Gbit/s), 100 ms latency per collective")
    ax.set_ylabel("compute utilisation")
    ax.set_ylim(0, max(1.05, top + 0.05))
    ax.grid(alpha=0.3, which="both")
    ax.set_title(
        "filled: measured, compute-only wall / row wall (side by side); hollow: 1 - exposed / "
        "wall\n(rank 0's timers); dashed: model, c = the fastest compute-only run's step",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy size, one link: proves it runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "bench"))
    parser.add_argument("--replot", action="store_true", help="redo .md/.png from the .json")
    args = parser.parse_args(argv)
    json_path = os.path.join(args.out, "frontier.json")
    if args.replot:
        with open(json_path) as f:
            results = json.load(f)
        derive(results)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        write_outputs(results, args.out)
        return results
    p = TINY if args.tiny else FULL
    shown = sys.argv[1:] if argv is None else argv
    command = " ".join(["python experiments/bench/frontier.py", *shown])
    t0 = time.perf_counter()
    results: dict = {
        "command": command,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_start": load_average(),
        "p": p,
        "links": p["links"],
        "rows": {},
        "baseline": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        text, results["corpus"] = corpus(tmp, tiny=args.tiny)
        base = job(p, text)
        n = 0

        def baseline() -> float:
            nonlocal n
            n += 1
            run = run_one([*base, "comm.disabled=true"], os.path.join(tmp, f"{n}"), "off")
            run["load"] = os.getloadavg()[0]
            results["baseline"].append(run)
            print(f"compute only: loop {run['wall_s']:.1f} s", flush=True)
            return run["wall_s"]

        compute_wall = 0.0 if p["paired"] else baseline()
        for link in p["links"]:
            gbps = LINKS[link]
            simulate = [
                f"comm.simulate.bandwidth_gbps={gbps}",
                f"comm.simulate.latency_ms={LATENCY_MS}",
            ]
            results["rows"][link] = {}
            for name, (overrides, tau) in rows(p).items():
                if p["paired"]:
                    compute_wall = baseline()
                n += 1
                load = os.getloadavg()[0]
                run = run_one([*base, *overrides, *simulate], os.path.join(tmp, f"{n}"), name)
                run.update(tau=tau, compute_wall_s=compute_wall, load=load)
                results["rows"][link][name] = run
                print(
                    f"{link} {name}: loop {run['wall_s']:.1f} s, exposed {run['comm_s']:.1f} s, "
                    f"{run['comm_bytes'] / 1e6:.2f} MB, test loss {run['test_loss']:.4f}",
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


def write_outputs(results: dict, out: str) -> None:
    text = render(results, results["command"])
    print(text, end="")
    with open(os.path.join(out, "FRONTIER.md"), "w") as f:
        f.write(text)
    plot(results, os.path.join(out, "frontier.png"))


if __name__ == "__main__":
    main()

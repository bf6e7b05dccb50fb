"""What a partitioned worker costs the others, with and without the heartbeat gate
(`ft.heartbeat_gate`, docs/reliability.md#a-worker-cut-off-from-its-peers-drops-itself).

The job: MNIST-1D-sized synthetic data, an MLP, every step padded to 50 ms
(`comm.simulate.step_s`), a sync every 4 steps, `ft=torchft`, 300 steps. One worker's data
plane is cut from its round after step 60 (`tests/faults.py`'s `partition`: its collectives
send nothing for P seconds while its process and heartbeats run on). Side by side in one
invocation, per setting and repetition: the fault-free run, then for each partition length P the
run with the gate (the default) and without it (`ft.heartbeat_gate=false`, torchft's own
heartbeats).

Two settings: the one the gate was built and tested with (3 workers, `ft.grace_s=1`,
`ft.heartbeat_timeout_s=1`, `ft.join_timeout_s=30`), and one it was not tuned on (4 workers,
every ft default: the adaptive window with its 3-s floor, a 2-s heartbeat timeout, a 60-s join
timeout).

The others' loss per fault: worker 0's training seconds (`wall_time_s - eval_seconds` of
summary.json) minus the fault-free run's of the same repetition. The bound the gate aims at is
one grace window plus the heartbeat timeout. Also recorded: worker 0's stall (the gaps between
its metrics lines, one a sync, over the median gap, summed over the 10 syncs from the fault
on), the fewest participants, heals, failed syncs and the goodput (merged samples per
training second) against the fault-free run.

    python experiments/partition_gate/partition_gate.py           # 2 repetitions, ~9 min
    python experiments/partition_gate/partition_gate.py --tiny    # smoke test, in /tmp
    python experiments/partition_gate/partition_gate.py --report  # the .md again from the .json

On the shared machine run it through `heavy`.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = [
    "data=synthetic", "data.num_samples=1200", "model=mlp", "model.hidden=[64]",
    "trainer.batch_size=16", "trainer.log_every=4", "trainer.eval_every=100000",
    "trainer.checkpoint_every=0", "trainer.progress=false", "sync.warmup_steps=4",
    "sync.period=4", "logger=jsonl", "logger.plots=false", "ft=torchft",
    "comm.simulate.step_s=0.05",
]  # fmt: skip
SETTINGS = {
    # name: (workers, overrides, grace window + heartbeat timeout: the bound)
    "3 workers, window 1 s, heartbeat 1 s": (
        3, ["ft.grace_s=1", "ft.heartbeat_timeout_s=1", "ft.join_timeout_s=30"], 2.0),
    "4 workers, ft defaults": (4, [], 3.0 + 2.0),  # the adaptive window's floor, 2-s heartbeat
}  # fmt: skip
FAULT_STEP, CUT_RANK = 60, 2


def run_one(setting: str, steps: int, run_dir: str, cut_s: float | None, gate: bool) -> dict:
    workers, overrides, _ = SETTINGS[setting]
    command = [
        sys.executable, "-m", "localsgd.train", *JOB, f"dist.world_size={workers}",
        f"comm.simulate.worker_speed=[{','.join(['1'] * workers)}]",
        f"trainer.max_steps={steps}", *overrides, f"ft.heartbeat_gate={str(gate).lower()}",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    if cut_s is not None:
        spec = f"partition:{CUT_RANK}:{FAULT_STEP}:{cut_s:g}"
        command.append(f"trainer.callbacks=[{{_target_:tests.faults.Fault,spec:'{spec}'}}]")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{setting}, cut {cut_s}, gate {gate} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    seen = [(r["step"], r["wall_time_s"]) for r in lines if "loss" in r and "wall_time_s" in r]
    gaps = [(b[0], b[1] - a[1]) for a, b in zip(seen, seen[1:], strict=False)]
    typical = statistics.median(g for _, g in gaps)
    # what worker 0 stood still around the fault: the gaps between its lines (one a sync) over
    # the median gap, summed over the 10 syncs from the fault on (a failed round's window and
    # the next quorum's wait fall in different gaps)
    near = [g - typical for step, g in gaps if FAULT_STEP < step <= FAULT_STEP + 40]
    return {
        "setting": setting,
        "cut_s": cut_s,
        "gate": gate,
        "train_s": round(s["wall_time_s"] - s["eval_seconds"], 3),
        "stall_s": round(sum(x for x in near if x > 0), 3),
        "participants_min": s["participants_min"],
        "heals": s["heals"],
        "failed_syncs": s["failed_syncs"],
        "merged_samples": s["merged_samples"],
        "gate_notices": proc.stderr.count("stopped heartbeating"),
    }


def measure(args) -> dict:
    runs = []
    out_dir = tempfile.mkdtemp(prefix="partition_gate-")
    for rep in range(args.reps):
        for setting in SETTINGS:
            order = [(None, True)] + [(c, g) for c in args.cuts for g in (True, False)]
            for cut_s, gate in order:
                name = f"r{rep}-{setting.split(',')[0].replace(' ', '')}-{cut_s}-{gate}"
                run = run_one(setting, args.steps, os.path.join(out_dir, name), cut_s, gate)
                run["rep"] = rep
                runs.append(run)
                print(json.dumps(run), flush=True)
    return {
        "date": datetime.date.today().isoformat(),
        "command": "python experiments/partition_gate/partition_gate.py " + " ".join(sys.argv[1:]),
        "steps": args.steps,
        "fault_step": FAULT_STEP,
        "cuts_s": args.cuts,
        "reps": args.reps,
        "runs": runs,
    }


def rows(result: dict) -> list[dict]:
    """Per setting and cut: the others' loss per fault, gate on and off, each repetition."""
    base = {(r["setting"], r["rep"]): r for r in result["runs"] if r["cut_s"] is None}
    out = []
    for setting, (_, _, bound) in SETTINGS.items():
        for cut_s in result["cuts_s"]:
            row = {"setting": setting, "cut_s": cut_s, "bound_s": bound}
            for gate in (True, False):
                key = (setting, cut_s, gate)
                runs = [r for r in result["runs"] if (r["setting"], r["cut_s"], r["gate"]) == key]
                if not runs:
                    continue
                lost = [r["train_s"] - base[(setting, r["rep"])]["train_s"] for r in runs]
                rate = {k: b["merged_samples"] / b["train_s"] for k, b in base.items()}
                goodput = [r["merged_samples"] / r["train_s"] / rate[(setting, r["rep"])]
                           for r in runs]  # fmt: skip
                row[gate] = {
                    "lost_s": [round(x, 2) for x in lost],
                    "lost_median_s": round(statistics.median(lost), 2),
                    "stall_s": [r["stall_s"] for r in runs],
                    "participants_min": min(r["participants_min"] for r in runs),
                    "heals": [r["heals"] for r in runs],
                    "goodput": [round(x, 3) for x in goodput],
                }
            if True in row and False in row:
                row["ratio"] = round(row[False]["lost_median_s"] / row[True]["lost_median_s"], 2)
            out.append(row)
    return out


def report(result: dict) -> str:
    def listed(xs):
        return ", ".join(f"{x:g}" for x in xs)

    lines = [
        "# The heartbeat gate: what a partitioned worker costs the others",
        "",
        f"{result['date']}, `{result['command'].strip()}`, {result['reps']} repetitions, "
        f"{result['steps']} steps of 50 ms, a sync every 4; worker {CUT_RANK}'s collectives "
        f"send nothing from its round after step {result['fault_step']} (its heartbeats run "
        "on). Lost: worker 0's training seconds minus the fault-free run's of the same "
        "repetition (each repetition, then the median). Stall: worker 0's gaps between metrics "
        "lines (one a sync) over the median gap, summed over the 10 syncs from the fault on. "
        "Goodput: merged samples (those that reached a committed round, all workers') per "
        "training second, over the fault-free run's.",
        "",
        "| setting | cut | bound (window + heartbeat) | lost, gate on | lost, gate off | off / on "
        "| stall on / off | fewest participants on / off | heals on / off | goodput on / off |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(result):
        on, off = row.get(True), row.get(False)
        if on is None or off is None:
            continue
        lines.append(
            f"| {row['setting']} | {row['cut_s']:g} s | {row['bound_s']:g} s "
            f"| {on['lost_median_s']:g} s ({listed(on['lost_s'])}) "
            f"| {off['lost_median_s']:g} s ({listed(off['lost_s'])}) | {row['ratio']:g}x "
            f"| {listed(on['stall_s'])} / {listed(off['stall_s'])} "
            f"| {on['participants_min']} / {off['participants_min']} "
            f"| {listed(on['heals'])} / {listed(off['heals'])} "
            f"| {listed(on['goodput'])} / {listed(off['goodput'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cuts", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--tiny", action="store_true", help="1 repetition, one cut, in /tmp")
    parser.add_argument("--report", action="store_true", help="the .md again from the .json")
    parser.add_argument("--out", default=os.path.join(HERE, "partition_gate"))
    args = parser.parse_args()
    if args.tiny:
        args.reps, args.cuts = 1, [4.0]
        args.out = os.path.join(tempfile.mkdtemp(prefix="partition_gate-tiny-"), "partition_gate")
    if args.report:
        with open(args.out + ".json") as f:
            result = json.load(f)
    else:
        result = measure(args)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(report(result))
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()

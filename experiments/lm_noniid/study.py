"""Non-iid text, a pilot: sync, local AdamW and DiLoCo on Shakespeare with each worker on its own
plays (`data.partition=contiguous`) beside the iid shards (`data.partition=iid`).

    make data                                        # the corpus, once
    python experiments/lm_noniid/study.py run        # 18 runs into /tmp/lm_noniid
    python experiments/lm_noniid/study.py export     # -> experiments/lm_noniid/runs.jsonl
    python experiments/lm_noniid/study.py run --world-size 2     # 18 runs
    python experiments/lm_noniid/study.py export --world-size 2   # adds 2-worker lines
    python experiments/lm_noniid/study.py report     # -> report.md and loss_vs_step*.png

The model, optimizer, batch, world size and simulated link are the Shakespeare study's `COMMON`
(experiments/lm_shakespeare/study.py), imported, with a shorter budget: 600 steps per worker,
evaluation every 100 steps. `--world-size 2` checks the pilot at 2 workers, nothing else changed.
`run` skips runs that finished and resumes ones that were cut short, so it can be restarted; it
runs seed by seed, so a cut-short study still has whole seeds. `report` reads only the committed
table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.lm_shakespeare.study import COMMON as SHAKESPEARE_COMMON  # noqa: E402

TABLE = HERE / "runs.jsonl"
RUNS = Path(os.environ.get("LM_NONIID_DIR", "/tmp/lm_noniid"))
SEEDS = (0, 1, 2)
STEPS = 600
EVAL_EVERY = 100
PARTITIONS = ("iid", "contiguous")
# 4: the pilot's setting (COMMON's); 2: a check on a setting the pilot was not tuned on
WORLD_SIZES = (4, 2)


def with_budget(common: list[str]) -> list[str]:
    """The Shakespeare study's settings with this study's budget in place of its own (replaced,
    not appended: one value per key on the command line)."""
    replace = {"trainer.max_steps": str(STEPS), "trainer.eval_every": str(EVAL_EVERY)}
    out = []
    for item in common:
        key = item.partition("=")[0]
        out.append(f"{key}={replace[key]}" if key in replace else item)
    missing = set(replace) - {item.partition("=")[0] for item in common}
    if missing:
        raise SystemExit(f"the Shakespeare study's COMMON no longer sets {sorted(missing)}")
    return out


COMMON = with_budget(SHAKESPEARE_COMMON)

ROWS = {
    # gradient all-reduce every step for the whole run: synchronous data-parallel AdamW
    "sync": [f"sync.warmup_steps={STEPS}", "sync.period=1"],
    # local AdamW, parameters averaged every 16 steps (plain averaging)
    "local_k16": ["sync.period=16"],
    # DiLoCo: outer Nesterov SGD (lr 0.7, momentum 0.9) every 16 steps, ~37 outer steps
    "diloco_h16": ["sync=diloco", "sync.period=16"],
}


def with_world_size(common: list[str], world_size: int) -> list[str]:
    """COMMON with `dist.world_size` replaced (in place, so the override lists of the 4-worker
    runs are unchanged)."""
    if "dist.world_size=4" not in common:
        raise SystemExit("the Shakespeare study's COMMON no longer sets dist.world_size=4")
    return [f"dist.world_size={world_size}" if item == "dist.world_size=4" else item
            for item in common]  # fmt: skip


def run_dir(row: str, partition: str, seed: int, world_size: int = 4) -> Path:
    # the 4-worker runs keep the pilot's names; other world sizes are tagged
    tag = "" if world_size == 4 else f"_w{world_size}"
    return RUNS / f"{row}_{partition}{tag}_s{seed}"


def command(row: str, partition: str, seed: int, world_size: int = 4) -> list[str]:
    out = run_dir(row, partition, seed, world_size)
    return [sys.executable, "-m", "localsgd.train", *with_world_size(COMMON, world_size),
            *ROWS[row], f"data.partition={partition}", f"seed={seed}",
            f"hydra.run.dir={out}"]  # fmt: skip


def run_all(
    rows: list[str], partitions: list[str], seeds: list[int], timeout: float, world_size: int = 4
) -> None:
    for seed in seeds:
        for row in rows:
            for partition in partitions:
                if (run_dir(row, partition, seed, world_size) / "summary.json").is_file():
                    continue
                cmd = command(row, partition, seed, world_size)
                print(" ".join(cmd[1:]), flush=True)
                # its own session, so a timeout ends the launcher and its 4 workers together
                proc = subprocess.Popen(cmd, start_new_session=True)
                try:
                    rc = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait()
                    msg = f"{row} {partition} seed {seed}: over {timeout:.0f} s, stopped"
                    raise SystemExit(msg) from None
                if rc != 0:
                    raise SystemExit(f"{row} {partition} seed {seed}: exit status {rc}")


def export(world_size: int = 4) -> None:
    """One line per finished run of `world_size` workers: row, partition, seed, world size, the
    final (whole validation set) loss and perplexity, communication per worker, wall time, the
    overrides and the validation curve. The table's lines for other world sizes are kept as they
    are (the pilot's 4-worker lines carry no `world_size` key: `read` takes them as 4)."""
    from localsgd.analysis.runs import load_run

    kept = []
    if TABLE.is_file():
        with open(TABLE, encoding="utf-8") as f:
            kept = [line for line in f if line.strip()
                    and json.loads(line).get("world_size", 4) != world_size]  # fmt: skip
    lines = []
    for seed in SEEDS:
        for row in ROWS:
            for partition in PARTITIONS:
                path = run_dir(row, partition, seed, world_size)
                if not (path / "summary.json").is_file():
                    continue
                run = load_run(str(path))
                s = run.summary
                curve = [m for m in run.metrics if "test_loss" in m]
                lines.append({
                    "row": row,
                    "partition": partition,
                    "seed": seed,
                    "world_size": world_size,
                    "test_loss": s["test_loss"],
                    "test_perplexity": s["test_perplexity"],
                    "comm_bytes": s["comm_bytes"],
                    "comm_rounds": s["comm_rounds"],
                    "wall_time_s": s["wall_time_s"],
                    "steps": s["steps"],
                    "overrides": command(row, partition, seed, world_size)[3:-1],
                    "curve": {"step": [m["step"] for m in curve],
                              "test_loss": [m["test_loss"] for m in curve]},
                })  # fmt: skip
    text = "".join(kept) + "".join(json.dumps(line) + "\n" for line in lines)
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {len(lines)} runs of {world_size} workers to {TABLE} ({len(kept)} others kept)")


def read() -> list[dict]:
    with open(TABLE, encoding="utf-8") as f:
        runs = [json.loads(line) for line in f if line.strip()]
    for r in runs:
        r.setdefault("world_size", 4)  # the pilot's lines predate the key
    return runs


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def holds(deltas: list[float], spread: float) -> bool:
    """A difference counts when it has the same sign on every seed and its mean is larger than
    the seeds' spread (the larger std of the cells compared, and the std of the paired deltas)."""
    if len(deltas) < 2:
        return False
    mean, std = mean_std(deltas)
    same_sign = all(d > 0 for d in deltas) or all(d < 0 for d in deltas)
    return same_sign and abs(mean) > max(spread, std)


def plot_name(world_size: int) -> str:
    return "loss_vs_step.png" if world_size == 4 else f"loss_vs_step_w{world_size}.png"


def report() -> None:
    runs = read()
    world_sizes = [w for w in WORLD_SIZES if any(r["world_size"] == w for r in runs)]
    lines = [
        f"{len(runs)} runs from `runs.jsonl` (mean ± std over seeds), {STEPS} steps per worker, "
        f"batch 16 x 64 characters per worker, at world sizes {', '.join(map(str, world_sizes))} "
        f"(everything else identical). Validation loss in nats per character on the whole "
        f"validation set (the last 10% of the corpus: plays no worker trains on), from the final "
        f"averaged model. Communication per worker. Wall time: the training loop on the simulated "
        f"1 Gbit/s, 100 ms link, on a shared 2-core machine.\n",
    ]
    for world_size in world_sizes:
        lines += report_world_size([r for r in runs if r["world_size"] == world_size], world_size)
    (HERE / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def report_world_size(runs: list[dict], world_size: int) -> list[str]:
    cell: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in runs:
        cell[(r["row"], r["partition"])][r["seed"]] = r
    seeds = sorted({r["seed"] for r in runs})

    def losses(row: str, partition: str) -> dict[int, float]:
        return {s: r["test_loss"] for s, r in cell[(row, partition)].items()}

    lines = [
        f"# {world_size} workers\n",
        f"{len(runs)} runs, seeds {seeds}, `dist.world_size={world_size}`.\n",
        f"## Final validation loss, {world_size} workers\n",
        "| row | partition | seeds | val loss | perplexity | comm rounds | comm MB | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        for partition in PARTITIONS:
            rs = list(cell[(row, partition)].values())
            if not rs:
                continue
            lines.append(
                f"| {row} | {partition} | {len(rs)} | {fmt([r['test_loss'] for r in rs], 4)} "
                f"| {fmt([r['test_perplexity'] for r in rs], 3)} "
                f"| {fmt([r['comm_rounds'] for r in rs], 0)} "
                f"| {fmt([r['comm_bytes'] / 1e6 for r in rs], 1)} "
                f"| {fmt([r['wall_time_s'] for r in rs], 0)} |"
            )

    lines += [
        f"\n## iid → contiguous, per method, {world_size} workers\n",
        "Δ = contiguous − iid validation loss, paired by seed (same seed: same initial model). "
        "*Counts*: Δ has the same sign on every seed and |mean Δ| is larger than the seeds' "
        "spread (the larger std of the two cells, and the std of the Δs).\n",
        "| row | iid | contiguous | Δ per seed | Δ mean ± std | counts |",
        "|---|---|---|---|---|---|",
    ]
    deltas: dict[str, dict[int, float]] = {}
    for row in ROWS:
        a, b = losses(row, "iid"), losses(row, "contiguous")
        common = sorted(set(a) & set(b))
        if not common:
            continue
        d = {s: b[s] - a[s] for s in common}
        deltas[row] = d
        spread = max(mean_std(list(a.values()))[1], mean_std(list(b.values()))[1])
        lines.append(
            f"| {row} | {fmt(list(a.values()), 4)} | {fmt(list(b.values()), 4)} "
            f"| {', '.join(f'{d[s]:+.4f}' for s in common)} | {fmt(list(d.values()), 4)} "
            f"| {'yes' if holds(list(d.values()), spread) else 'no'} |"
        )

    lines += [
        f"\n## Method against method, within each partition, {world_size} workers\n",
        "Difference of validation loss, paired by seed; the same rule for *counts*. Last rows: "
        "whether the non-iid penalty (Δ above) differs between two methods.\n",
        "| comparison | per seed | mean ± std | counts |",
        "|---|---|---|---|",
    ]
    pairs = [("diloco_h16", "sync"), ("local_k16", "sync"), ("diloco_h16", "local_k16")]
    for partition in PARTITIONS:
        for x, y in pairs:
            a, b = losses(x, partition), losses(y, partition)
            common = sorted(set(a) & set(b))
            if not common:
                continue
            d = [a[s] - b[s] for s in common]
            spread = max(mean_std(list(a.values()))[1], mean_std(list(b.values()))[1])
            lines.append(
                f"| {x} − {y}, {partition} | {', '.join(f'{v:+.4f}' for v in d)} "
                f"| {fmt(d, 4)} | {'yes' if holds(d, spread) else 'no'} |"
            )
    for x, y in pairs:
        if x not in deltas or y not in deltas:
            continue
        common = sorted(set(deltas[x]) & set(deltas[y]))
        d = [deltas[x][s] - deltas[y][s] for s in common]
        spread = max(mean_std(list(deltas[x].values()))[1], mean_std(list(deltas[y].values()))[1])
        lines.append(
            f"| Δ({x}) − Δ({y}) | {', '.join(f'{v:+.4f}' for v in d)} "
            f"| {fmt(d, 4)} | {'yes' if holds(d, spread) else 'no'} |"
        )

    lines += [
        f"\n## Per run, {world_size} workers\n",
        "| row | partition | seed | val loss | wall s |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(
        runs,
        key=lambda r: (list(ROWS).index(r["row"]), PARTITIONS.index(r["partition"]), r["seed"]),
    ):
        lines.append(
            f"| {r['row']} | {r['partition']} | {r['seed']} | {r['test_loss']:.4f} "
            f"| {r['wall_time_s']:.0f} |"
        )
    name = plot_name(world_size)
    lines.append(f"\n![validation loss against step, {world_size} workers]({name})\n")
    plot(cell, world_size)
    return lines


def plot(cell, world_size: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"sync": "tab:grey", "local_k16": "tab:blue", "diloco_h16": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in ROWS:
        for partition in PARTITIONS:
            rs = list(cell[(row, partition)].values())
            if not rs:
                continue
            points = defaultdict(list)
            for r in rs:
                for step, loss in zip(r["curve"]["step"], r["curve"]["test_loss"], strict=True):
                    points[step].append(loss)
            steps = sorted(s for s in points if len(points[s]) == len(rs))
            ax.plot(steps, [statistics.fmean(points[s]) for s in steps],
                    "-" if partition == "iid" else "--", marker=".", color=colours[row],
                    label=f"{row}, {partition}")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/char), mean over seeds")
    ax.set_title(f"{world_size} workers. solid: iid shards; dashed: contiguous "
                 f"(each worker its own plays)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(HERE / plot_name(world_size), dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", choices=("run", "export", "report"))
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--partitions", nargs="*", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (300)")
    parser.add_argument("--world-size", type=int, default=4, choices=WORLD_SIZES,
                        help="workers per run (4, the pilot's; 2)")  # fmt: skip
    args = parser.parse_args()
    if args.action == "run":
        run_all(args.rows, args.partitions, args.seeds, args.timeout, args.world_size)
    elif args.action == "export":
        export(args.world_size)
    else:
        report()


if __name__ == "__main__":
    main()

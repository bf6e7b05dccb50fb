"""The performance suite: runs every benchmark and writes experiments/bench/RESULTS.md.

    python experiments/bench/run.py            # the full suite, ~10 min on 2 cores (make bench)
    python experiments/bench/run.py --tiny     # every item at toy size, under a minute (a test)

All figures are ratios of things measured side by side in the same processes, interleaved over
repetitions; absolute times are context only (the machine may be shared). Items:
1-2 averaging cost, low-precision and hierarchical averaging (averaging.py), 3 trainer throughput
vs k, with and without `sync.overlap` (item 6), 4 framework overhead, 5 memory (training.py).
Item 6's accuracy effect is measured by experiments/overlap/overlap_study.py (training runs).
After the suite, ft_sync.py measures a sync through torchft's quorum against plain
torch.distributed (FT_SYNC.md, ~1 min). The full suite ends with the communication frontier
(frontier.py, 7-10 min more: the LM job on a simulated 1 Gbit/s and 100 Mbit/s link, writing
FRONTIER.md and frontier.png beside --out);
`--no-frontier` skips it, `python experiments/bench/frontier.py` runs it alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: make `experiments.bench` importable (and in workers)
    sys.path.insert(0, ROOT)

from experiments.bench import averaging, frontier, ft_sync, training  # noqa: E402
from experiments.bench.common import load_average, machine  # noqa: E402

FULL = {
    "worlds": [2, 4],
    "sizes": [1_000_000, 10_000_000, 50_000_000],
    "avg_reps": 10,
    "features": 1024,
    "hidden": [2048, 2048, 2048],  # ~10.5M parameters
    "batch": 48,  # one all-reduce of the model ~ half a step, as item 3 asks
    "steps": 96,
    "train_reps": 5,  # throughput moves by +-4% between runs: more reps, a steadier median
    "memory_steps": 24,
}
TINY = {
    "worlds": [2],
    "sizes": [10_000],
    "avg_reps": 2,
    "features": 16,
    "hidden": [32],
    "batch": 8,
    "steps": 8,
    "train_reps": 1,
    "memory_steps": 4,
}

NOT_MEASURED = """## Not measured here

- CUDA/NCCL: this machine has no GPU. On NCCL the averager uses `ReduceOp.AVG` (no division
  pass), bf16/fp16 are reduced on the GPU, and `sync.overlap` runs its all-reduces on NCCL's own
  stream; none of those timings are in this file.
- Compressed and hierarchical averaging are measured on gloo only; the hierarchical levels at world
  4 only (pairs every step, all 4 every 2nd step), on one machine, so there is no slow inter-node
  link for the narrow level to avoid.
- accelerate's LocalSGD: accelerate is not installed (it averages with a barrier and one
  `accelerator.reduce(param.data, "mean")` per parameter: the per-tensor column's pattern).
- `sync.overlap`'s effect on accuracy, and on a network that is not the training's own CPU:
  experiments/overlap/overlap_study.md.
"""


def compose_base(p: dict) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import localsgd.cli.train  # noqa: F401  (registers the config schema)

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose(
            "config", overrides=training.job_overrides(p["features"], p["hidden"], p["batch"])
        )
    return OmegaConf.to_container(cfg, resolve=True)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes: proves the suite runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments/bench/RESULTS.md"))
    parser.add_argument("--timeout", type=float, default=600.0, help="gloo/store timeout (s)")
    parser.add_argument(
        "--no-frontier", action="store_true", help="skip the communication frontier (frontier.py)"
    )
    args = parser.parse_args(argv)
    p = TINY if args.tiny else FULL
    shown = sys.argv[1:] if argv is None else argv
    command = " ".join(["python experiments/bench/run.py", *shown])
    started = datetime.datetime.now(datetime.timezone.utc)
    load_start = load_average()
    t0 = time.perf_counter()

    rows = averaging.run(p["worlds"], p["sizes"], p["avg_reps"], args.timeout)
    print(f"averaging done after {time.perf_counter() - t0:.0f} s", flush=True)
    result = training.run(
        compose_base(p), p["steps"], p["train_reps"], p["memory_steps"], args.timeout
    )
    print(f"training done after {time.perf_counter() - t0:.0f} s", flush=True)

    lines = [
        "# Performance suite results",
        "",
        f"- command: `{command}`",
        f"- started: {started.isoformat(timespec='seconds')}; whole suite: "
        f"{time.perf_counter() - t0:.0f} s",
        f"- machine: {machine()}",
        f"- load average (1/5/15 min) at start: {load_start}; at end: {load_average()} "
        "(other jobs shared the cores when this is above the core count)",
        *(
            []
            if args.tiny or args.no_frontier
            else ["- the communication frontier: FRONTIER.md, run after this file is written"]
        ),
        "",
        *averaging.render(rows, p["avg_reps"]),
        "",
        *training.render(result),
        "",
        NOT_MEASURED,
    ]
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text, end="")
    if not args.tiny and importlib.util.find_spec("torchft") is not None:
        # a sync through torchft's quorum against plain torch.distributed (ft_sync.py)
        out_dir = os.path.dirname(os.path.abspath(args.out))
        ft_sync.main(["--out", os.path.join(out_dir, "FT_SYNC.md")])
        print(f"ft_sync done after {time.perf_counter() - t0:.0f} s", flush=True)
    if not (args.tiny or args.no_frontier):  # its own test runs it at toy size
        out_dir = os.path.dirname(os.path.abspath(args.out))
        default = os.path.abspath(os.path.join(ROOT, "experiments/bench"))
        frontier.main([] if out_dir == default else ["--out", out_dir])
        print(f"frontier done after {time.perf_counter() - t0:.0f} s", flush=True)
    return text


if __name__ == "__main__":
    main()

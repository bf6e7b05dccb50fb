"""What the default NaN/Inf guard (`localsgd.averaging.finite`) costs a clean average.

`PeriodicAverager(1, module=model).average()` (guarded: checked in the pass that divides the
buffer before a SUM all-reduce where the group is a power of two, else one summing pass before
gloo's AVG; one read of the reduced canary after) against the same averager with
`drop_nonfinite=False` and gloo's own AVG of a raw buffer, timed side by side in the same gloo
processes by the averaging suite (`experiments/bench/averaging.py`: methods interleaved
round-robin, a barrier before each call, a rep's time the max over ranks). Prints each (world,
size)'s medians as ratios, and the median of the per-rep ratios guarded / unguarded.

    python experiments/bench/nonfinite_guard.py --worlds 2 --sizes 9800000 --reps 36
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: make `experiments.bench` importable (and in workers)
    sys.path.insert(0, ROOT)

from experiments.bench import averaging  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    rows = averaging.run(args.worlds, args.sizes, args.reps, timeout_s=1200)
    for row in rows:
        times = row["max"]
        med = {m: statistics.median(times[m]) for m in ("raw", "ours", "unguarded", "gloo-avg")}
        per_rep = [a / b for a, b in zip(times["ours"], times["unguarded"], strict=True)]
        print(
            json.dumps(
                {
                    "world": row["world"],
                    "params": row["numel"],
                    "raw_ms": round(med["raw"] * 1e3, 2),
                    "guarded_vs_raw": round(med["ours"] / med["raw"], 3),
                    "unguarded_vs_raw": round(med["unguarded"] / med["raw"], 3),
                    "guarded_vs_unguarded": round(med["ours"] / med["unguarded"], 3),
                    "guarded_vs_gloo_avg": round(med["ours"] / med["gloo-avg"], 3),
                    "unguarded_vs_gloo_avg": round(med["unguarded"] / med["gloo-avg"], 3),
                    "per_rep_ratio_median": round(statistics.median(per_rep), 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

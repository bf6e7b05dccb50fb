"""How finely the chaos study's test set tells two of its models apart: a setting's fault-free
run twice (on the wall clock the two differ, as a chaos run differs from its fault-free
reference), and the ratio of their test losses with its paired bootstrap 95% interval over the
test samples (`experiments/stragglers/paired.py`). An interval wider than a target means the
test set cannot resolve that target on this job, whatever the faults did.

    python experiments/chaos/resolution.py --seeds 0 1 --out chaos_resolution   # ~6 min a seed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "stragglers"))

import paired  # noqa: E402
from chaos_study import SETTINGS, run_one  # noqa: E402

SETTING = "async MNIST-1D DiLoCo, H = 16, 50 ms, grace 0.1 s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", default=SETTING, choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", default="chaos_resolution")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            dirs = [os.path.join(tmp, f"{seed}-{run}") for run in ("first", "second")]
            runs = [run_one(args.setting, seed, args, d, None) for d in dirs]
            ratio, lo, hi = paired.ratio_interval(*(paired.test_losses(d) for d in dirs))
            rows.append({"seed": seed, "test_loss": [r["test_loss"] for r in runs],
                         "ratio": ratio, "lo": lo, "hi": hi})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# The chaos study's test set: how finely it resolves a loss ratio",
        "",
        f"Run {stamp}, `python experiments/chaos/resolution.py {shlex.join(sys.argv[1:])}`: "
        f'the setting "{args.setting}" fault-free twice per seed, {args.steps} steps, 4 '
        "workers; the second run's test loss against the first's, with the paired bootstrap 95% "
        "interval over the test samples.",
        "",
        "| seed | test loss, first and second run | second vs first [95% interval] |",
        "|---|---|---|",
        *(
            f"| {r['seed']} | {r['test_loss'][0]:.4f}, {r['test_loss'][1]:.4f} | "
            f"{r['ratio']:+.2%} [{r['lo']:+.2%}, {r['hi']:+.2%}] |"
            for r in rows
        ),
    ]
    out = os.path.join(HERE, args.out)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Compressed averaging on MNIST-1D: the same runs (same seed) in fp32 and low precision.

    python experiments/comm_dtype/compare_comm_dtype.py \
        --out experiments/comm_dtype/compare_comm_dtype.md

Each row is a real `python -m localsgd.train` run (4 CPU workers, the default CNN, 3000 steps);
bytes are the payload one worker put into all-reduces, ratios are to the fp32 run of the same
strategy, measured in this one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
STRATEGIES = {
    "local SGD, k=16": ["+experiment=local_sgd"],
    "local SGD, k=4": ["+experiment=local_sgd", "sync.period=4"],
    # the paper's outer step, as the committed results ran (the preset now warms it up)
    "DiLoCo, H=50": ["+experiment=diloco", "sync.outer_warmup_rounds=0"],
}
DTYPES = ("float32", "bfloat16", "float16")


def run(args: list[str], run_dir: str) -> dict:
    cmd = [sys.executable, "-m", "localsgd.train", *args, "trainer.progress=false"]
    subprocess.run(cmd + [f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file to write (default: print)")
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    lines = [
        "| strategy | comm_dtype | test accuracy | test loss | comm bytes | vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.strategies:
            base = None
            for dtype in opts.dtypes:
                args = [*STRATEGIES[name], f"sync.comm_dtype={dtype}", f"seed={opts.seed}"]
                s = run(args, os.path.join(tmp, f"{len(lines)}"))
                base = s["comm_bytes"] if dtype == "float32" else base
                ratio = f"{s['comm_bytes'] / base:.3f}" if base else "n/a"
                lines.append(
                    f"| {name} | {dtype} | {s['test_accuracy']:.4f} | {s['test_loss']:.4f} "
                    f"| {s['comm_bytes']:,} | {ratio} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if opts.out:
        with open(opts.out, "w", encoding="utf-8") as f:
            command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
            f.write(f"`{command}`\n\n" + text)


if __name__ == "__main__":
    main()

"""The pair matrix: 19 modes (issue 47's 18, and issue 48's asynchronous rounds), each added to
a 64-step, 4-worker MNIST-1D job with replica checks on, crossed in pairs (issue 47's
composition target).

    python experiments/pair_matrix/pair_matrix.py [--only NAME ...] [--out DIR] [--extra K=V ...]

Every pair runs `python -m localsgd.train` for real: a refusal is the one line the CLI exits 2
with, before any worker starts; an accepted pair must exit 0 with every sync checked
bit-identical (`replica_checks` in summary.json). Writes `pair_matrix.json` and
`pair_matrix.md` beside this script (or in --out).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

JOB = [
    "data=mnist1d",
    "dist.world_size=4",
    "trainer.max_steps=64",
    "sync.warmup_steps=0",
    "sync.period=8",
    "logger=jsonl",
    "sync.check_replicas=true",
    "trainer.progress=false",
    "logger.plots=false",
]

# name: the overrides that add the mode (issue 47's list, in its order)
MODES: dict[str, list[str]] = {
    "diloco": ["sync.outer=diloco", "optim=adamw"],
    "streaming": ["sync.outer=diloco", "optim=adamw", "sync.fragments=2"],
    "delay": ["sync.delay_steps=1"],
    "levels": ["sync.levels=[{group_size:2,period:4},{group_size:world,period:8}]"],
    "int4": ["sync.comm_dtype=int4", "sync.error_feedback=true"],
    "topk": ["sync.compress=topk", "sync.error_feedback=true"],
    "shard": ["dist.shard_size=2"],
    "torchft": ["ft=torchft"],
    "budget": [
        "sync.inner_time_s=0.2",
        "comm.simulate.worker_speed=[1,1,1,3]",
        "comm.simulate.step_s=0.01",
    ],
    "median": ["sync.aggregate=median"],
    "score": ["sync.score=true"],
    "muon": ["optim=muon", "model=mlp"],
    "desloc": ["sync.optimizer_state=desloc"],
    "cpu_state": ["sync.outer=diloco", "sync.outer_state=cpu"],
    "adaptive": ["sync.schedule=adaptive"],
    "eager": ["sync.outer=diloco", "sync.eager=true"],
    "virtual": ["dist.virtual_workers=4"],
    "bf16": ["sync.comm_dtype=bfloat16"],
    # issue 48's asynchronous rounds (DiLoCo, worker 3 three times slower: the budget's clock)
    "async": [
        "sync.mode=async",
        "sync.outer=diloco",
        "optim=adamw",
        "comm.simulate.worker_speed=[1,1,1,3]",
        "comm.simulate.step_s=0.01",
    ],
}


def _key(override: str) -> str:
    return override.split("=", 1)[0]


def combine(a: str, b: str) -> list[str] | None:
    """The overrides of modes `a` and `b` together; None when they set one key to two values
    (two wire dtypes: not a combination). `optim=muon` wins over DiLoCo's inner AdamW: DiLoCo
    with Muon inner steps is the combination meant."""
    out: dict[str, str] = {}
    for override in MODES[a] + MODES[b]:
        key = _key(override)
        if key == "optim" and "optim=muon" in MODES[a] + MODES[b]:
            out[key] = "optim=muon"
            continue
        if key in out and out[key] != override:
            return None
        out[key] = override
    return list(out.values())


def run_one(overrides: list[str], timeout: float, extra: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "localsgd.train", *JOB, *overrides, *extra,
               f"hydra.run.dir={tmp}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "seconds": timeout}
        seconds = round(time.perf_counter() - start, 1)
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        if proc.returncode == 2:
            return {"status": "refused", "line": lines[-1] if lines else "", "seconds": seconds}
        summary_path = os.path.join(tmp, "summary.json")
        summary = {}
        if os.path.exists(summary_path):
            with open(summary_path) as f:
                summary = json.load(f)
        ok = proc.returncode == 0 and summary.get("replica_checks", 0) > 0
        model = os.path.join(tmp, "model.pt")
        digest = None
        if os.path.exists(model):
            import torch

            state = torch.load(model, weights_only=True)
            h = hashlib.sha256()
            for name in sorted(state):
                h.update(name.encode())
                h.update(
                    state[name]
                    .detach()
                    .cpu()
                    .contiguous()
                    .view(-1)
                    .view(torch.uint8)
                    .numpy()
                    .tobytes()
                )
            digest = h.hexdigest()[:16]
        return {
            "status": "ok" if ok else "crashed",
            "exit": proc.returncode,
            "replica_checks": summary.get("replica_checks"),
            "test_accuracy": summary.get("test_accuracy"),
            "model_sha": digest,  # the final model's bits (a bit-for-bit comparison of code)
            "seconds": seconds,
            "tail": "" if ok else "\n".join(lines[-6:]),
        }


def markdown(results: dict) -> str:
    names = list(MODES)
    short = {n: n[:6] for n in names}
    mark = {"ok": "+", "refused": "R", "crashed": "X", "timeout": "T", "same key": "."}
    rows = ["| | " + " | ".join(short[n] for n in names) + " |",
            "|---|" + "---|" * len(names)]  # fmt: skip
    for a in names:
        cells = []
        for b in names:
            if a == b:
                cells.append(mark.get(results.get(a, {}).get("status"), "?"))
                continue
            key = f"{a}+{b}" if f"{a}+{b}" in results else f"{b}+{a}"
            cells.append(mark.get(results.get(key, {}).get("status"), " "))
        rows.append(f"| {a} | " + " | ".join(cells) + " |")
    pairs = {k: v for k, v in results.items() if "+" in k and v["status"] != "same key"}
    counts = {s: sum(v["status"] == s for v in pairs.values()) for s in mark}
    out = [
        "# The pair matrix",
        "",
        f"Each of {len(names)} modes added to `" + " ".join(JOB[:-2]) + "`, crossed in pairs; "
        "`+` ran to exit 0 with its replica checks passing, `R` refused before any worker "
        "started, `X` crashed or failed a check, `.` one key set two ways (not a combination). "
        "The diagonal is each mode alone.",
        "",
        f"Pairs: {len(pairs)}; " + ", ".join(f"{s} {n}" for s, n in counts.items() if n) + ".",
        "",
        *rows,
        "",
        "## Refused pairs",
        "",
    ]
    for key, v in results.items():
        if v["status"] == "refused":
            out.append(f"- `{key}`: {v['line']}")
    bad = [(k, v) for k, v in results.items() if v["status"] in ("crashed", "timeout")]
    if bad:
        out += ["", "## Crashed", ""]
        for key, v in bad:
            out.append(f"- `{key}` (exit {v.get('exit')}): {v.get('tail', '')[-400:]!r}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="modes whose pairs to run (default: all)")
    parser.add_argument("--pairs", nargs="*", help="only these pairs (a+b ...)")
    parser.add_argument("--singles", action="store_true", help="also each mode alone")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--out", default=HERE)
    parser.add_argument(
        "--extra", nargs="*", default=[],
        help="overrides added to every run (data.val_fraction=0: the data split of code before "
        "the validation split, to compare model bits with it)",
    )  # fmt: skip
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pair_matrix.json")
    results: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    todo = []
    if args.singles:
        todo += [(n,) for n in MODES if not args.only or n in args.only]
    for a, b in itertools.combinations(MODES, 2):
        if args.only and a not in args.only and b not in args.only:
            continue
        if args.pairs and f"{a}+{b}" not in args.pairs and f"{b}+{a}" not in args.pairs:
            continue
        todo.append((a, b))
    for names in todo:
        key = "+".join(names)
        overrides = MODES[names[0]] if len(names) == 1 else combine(*names)
        if overrides is None:
            results[key] = {"status": "same key"}
            continue
        results[key] = run_one(overrides, args.timeout, args.extra)
        print(f"{key:22s} {results[key]['status']:8s} {results[key].get('line', '')[:150]}"
              f"{results[key].get('tail', '')[-300:]}", flush=True)  # fmt: skip
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "pair_matrix.md"), "w") as f:
        f.write(markdown(results))


if __name__ == "__main__":
    main()

"""What an asynchronous exchange costs against a synchronous DiLoCo round, side by side in the
same gloo workers: each mode trains the same steps (a sleep of `--step-ms` for the compute, every
worker equally fast, on the wall clock), and its cost is its run's time over the same steps with
no averaging at all, per phase. Modes, interleaved within each repetition:

- `sync`: `OuterAverager`, an all-reduce of the flat fp32 buffer every `--period` steps;
- `async`: `AsyncAverager` with the default adaptive grace window: each worker sends its
  pseudo-gradient to the syncer on rank 0 and takes the global model back (point-to-point, or
  an all-reduce where every worker's contribution is in one merge: `async_exchanges`);
- `async, grace 0`: every contribution merged alone, point-to-point only.

With `--bandwidth-gbps` every transfer is slowed to that link (`comm.simulate`: the collectives,
and at both ends each point-to-point transfer, so the syncer's queue on its one link).

    python experiments/bench/async_exchange.py --world 4 --sizes 100000 1000000 4000000 --reps 3
    python experiments/bench/async_exchange.py --world 4 --sizes 1000000 4000000 --reps 3 \
        --bandwidth-gbps 1
    python experiments/bench/async_exchange.py --tiny   # seconds: what `make test-long` runs

Ratios are of medians over `--reps` runs measured in the same processes; the absolute times on
a shared machine are for orientation only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: make `experiments.bench` importable (and in workers)
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from experiments.bench.common import run_world  # noqa: E402
from localsgd.averaging import OuterAverager  # noqa: E402
from localsgd.averaging.asynchronous import AsyncAverager  # noqa: E402
from localsgd.averaging.comm import SimulatedLink  # noqa: E402

MODES = ("none", "sync", "async", "async, grace 0")
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}


class _Flat(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.01)


def _averager(mode: str, model: torch.nn.Module, spec: dict, run: str):
    period, link = spec["period"], spec["link"]
    link = None if link is None else SimulatedLink(*link)
    if mode == "sync":
        return OuterAverager(period, module=model, link=link, **OUTER)
    store = dist.distributed_c10d._get_default_store()
    grace = 0.0 if mode == "async, grace 0" else None
    return AsyncAverager(
        period, module=model, store=store, run_id=run, max_steps=spec["steps"],
        min_quorum=1, grace_s=grace, timeout_s=120, link=link, **OUTER,
    )  # fmt: skip


def _run(mode: str, n: int, spec: dict, run: str) -> dict:
    """One run of `mode`: its seconds from the first step to the last, and what it did."""
    model = _Flat(n)
    averager = None if mode == "none" else _averager(mode, model, spec, run)
    dist.barrier()
    start = time.perf_counter()
    for step in range(spec["steps"]):
        time.sleep(spec["step_s"])  # the compute
        with torch.no_grad():
            model.weight.add_(1e-4 * (dist.get_rank() + 1) * (step % 3 - 1))
        if averager is not None:
            averager.trained(1)
            averager.maybe_average()
    seconds = time.perf_counter() - start
    out = {"seconds": seconds}
    if isinstance(averager, AsyncAverager):
        summary = averager.summary()
        out["exchanges"] = summary["async_exchanges"]
        out["merges"] = summary.get("async_merges")
    dist.barrier()
    return out


def _worker(rank: int, world_size: int, args: dict) -> dict:
    torch.set_num_threads(1)
    results: dict = {}
    for n in args["sizes"]:
        for rep in range(args["reps"]):
            for mode in MODES:
                run = f"{n}/{rep}/{mode}"
                got = _run(mode, n, args, run)
                results.setdefault(str(n), {}).setdefault(mode, []).append(got)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--period", type=int, default=4)
    parser.add_argument("--steps", type=int, default=41)  # 11 phases: after step 0, every 4
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument(
        "--bandwidth-gbps", type=float, help="a simulated link (comm.simulate.bandwidth_gbps)"
    )
    parser.add_argument("--json", help="also write the per-run figures here")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.world, args.sizes, args.reps, args.steps = 2, [1000], 1, 9
    link = None if args.bandwidth_gbps is None else (args.bandwidth_gbps, 0.0)
    spec = {"sizes": args.sizes, "reps": args.reps, "period": args.period,
            "steps": args.steps, "step_s": args.step_ms / 1000, "link": link}  # fmt: skip
    results = run_world(_worker, args.world, spec)
    phases = len([s for s in range(args.steps) if s % args.period == 0])
    wire = "as is" if link is None else f"{args.bandwidth_gbps:g} Gbit/s (simulated)"
    print(
        f"{args.world} gloo workers, {args.steps} steps of {args.step_ms:g} ms, a phase every "
        f"{args.period} ({phases} phases; the last step a meeting under async), link {wire}; "
        "per phase: the run's seconds over the no-averaging run's, median over reps and ranks"
    )
    print("| fp32 params | sync round | async exchange | async, grace 0 | async vs sync | "
          "async exchanges (p2p / collective) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    table = {}
    for n in args.sizes:
        key = str(n)
        med = {m: statistics.median(r[key][m][i]["seconds"] for r in results
                                    for i in range(args.reps)) for m in MODES}  # fmt: skip
        cost = {m: (med[m] - med["none"]) / phases for m in MODES if m != "none"}
        ex = results[0][key]["async"][-1]["exchanges"]
        ratio = cost["async"] / cost["sync"] if cost["sync"] > 0 else float("nan")
        print(
            f"| {n:,} | {cost['sync'] * 1e3:.1f} ms | {cost['async'] * 1e3:.1f} ms | "
            f"{cost['async, grace 0'] * 1e3:.1f} ms | {ratio:.2f}x | "
            f"{ex['p2p']} / {ex['collective']} |"
        )
        table[key] = {"cost_s": cost, "median_s": med, "async_exchanges": ex}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "table": table, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()

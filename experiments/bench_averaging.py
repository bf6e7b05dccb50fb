"""Cost of one model average over gloo on CPU, as a ratio to one raw all-reduce of the same bytes.

For each world size and model size, the workers time four ways of averaging, side by side in the
same processes and interleaved round-robin across repetitions (so noise hits all of them alike),
with a `dist.barrier()` before each timed call:

  raw         one `dist.all_reduce` of one preallocated flat fp32 buffer of the same total size
  ours        `PeriodicAverager(model, period=1).average()` (in place over a persistent flat buffer)
  torch       `torch.distributed.algorithms.model_averaging.utils.average_parameters`
  per-tensor  one `all_reduce` per parameter tensor, then a division

A rep's time for a method is the max over ranks; the table gives the median over reps.

    python experiments/bench_averaging.py                                   # full run, ~5 min
    python experiments/bench_averaging.py --sizes 1e4 --worlds 2 --reps 2   # smoke test, seconds
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from localsgd.averaging import PeriodicAverager
from localsgd.launch import WorkerInfo, init_process_group, spawn

METHODS = ("raw", "ours", "torch", "per-tensor")
N_LAYERS = 26  # each layer: a weight (2-D, or 4-D conv-like) and a bias -> 52 tensors


class Blob(nn.Module):
    """Parameters only: varied shapes summing to about `target` fp32 elements."""

    def __init__(self, target: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # Layer sizes spread over ~2 orders of magnitude, like a real network's.
        weights = torch.exp(torch.rand(N_LAYERS, generator=g) * 4.6)
        weights /= weights.sum()
        params = []
        for i, w in enumerate(weights.tolist()):
            numel = max(4, int(target * w))
            rows = max(1, int(numel**0.5 * (0.25 + 1.5 * (i % 5) / 4)))
            cols = max(1, numel // rows)
            if i % 4 == 3 and cols >= 9:  # conv-like: (out, in, 3, 3)
                shape: tuple[int, ...] = (rows, max(1, cols // 9), 3, 3)
            else:
                shape = (rows, cols)
            params.append(nn.Parameter(torch.randn(shape, generator=g)))
            params.append(nn.Parameter(torch.randn(rows, generator=g)))
        self.params = nn.ParameterList(params)


def _per_tensor(params: list[torch.Tensor], group, world_size: int) -> None:
    for p in params:
        dist.all_reduce(p.data, group=group)
        p.data.div_(world_size)


def _bench_size(target: int, reps: int, rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    model_ours = Blob(target)
    model_torch = Blob(target)
    model_naive = Blob(target)
    numel = sum(p.numel() for p in model_ours.parameters())
    n_tensors = len(list(model_ours.parameters()))
    averager = PeriodicAverager(model_ours, period=1, process_group=group)
    raw = torch.randn(numel)
    # Summing without dividing doubles (or quadruples) `raw` per call; stay far from fp32 overflow.
    raw_scale = 1.0 / world_size
    naive_params = list(model_naive.parameters())

    def run_raw():
        dist.all_reduce(raw, group=group)

    calls = {
        "raw": run_raw,
        "ours": averager.average,
        "torch": lambda: average_parameters(model_torch.parameters(), group),
        "per-tensor": lambda: _per_tensor(naive_params, group, world_size),
    }
    for name in METHODS:  # warm-up: first-touch page faults, gloo's connection buffers
        dist.barrier()
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for rep in range(reps):
        order = METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
        if rep % 8 == 7:
            raw.mul_(raw_scale**8)  # outside the timed calls
    return {"target": target, "numel": numel, "tensors": n_tensors, "times": times}


def _worker(info: WorkerInfo, store, sizes: list[int], reps: int, out_dir: str,
            timeout_s: float) -> None:
    torch.set_num_threads(1)
    init_process_group(info, "gloo", timeout_s, store)
    try:
        results = []
        for n in sizes:
            results.append(_bench_size(n, reps, info.rank, info.world_size))
            gc.collect()  # the models of this size are gone before the next is built
        with open(os.path.join(out_dir, f"{info.rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, sizes: list[int], reps: int, timeout_s: float) -> list[dict]:
    """Per size: numel, tensors, and per method the per-rep times (max over ranks) in seconds."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_worker, world_size, timeout_s, args=(sizes, reps, out_dir, timeout_s))
        per_rank = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                per_rank.append(json.load(f))
    rows = []
    for i, first in enumerate(per_rank[0]):
        row = {"world": world_size, "target": first["target"], "numel": first["numel"],
               "tensors": first["tensors"], "rank0": first["times"], "max": {}}
        for name in METHODS:
            row["max"][name] = [max(ranks[i]["times"][name][k] for ranks in per_rank)
                                for k in range(reps)]
        rows.append(row)
    return rows


def _fmt_params(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return str(n)


def render(rows: list[dict], command: str, reps: int, elapsed_s: float) -> str:
    med = statistics.median
    lines = [
        "# Averaging cost: ours vs torch vs per-tensor, relative to one raw all-reduce",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} CPUs (nproc), {platform.machine()}, "
        f"{platform.platform()}; Python {platform.python_version()}; torch {torch.__version__}; "
        "backend gloo on CPU (loopback TCP), torch.set_num_threads(1) per worker",
        f"- reps: {reps} per method per (world, size), after one warm-up call each; methods "
        "interleaved round-robin (starting method rotated each rep), `dist.barrier()` before "
        "each timed call",
        "- time of a rep = max over ranks; table = median over reps. `raw ms` is the absolute "
        "median; the other columns are ratios of medians to raw. Rank 0's own medians in "
        "parentheses.",
        f"- total runtime of the run: {elapsed_s:.0f} s",
        "",
        "| world | params | tensors | MB/rank | raw ms | ours x | torch x | per-tensor x |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m = {name: med(row["max"][name]) for name in METHODS}
        r0 = {name: med(row["rank0"][name]) for name in METHODS}
        cells = [f"{m[name] / m['raw']:.2f} ({r0[name] / r0['raw']:.2f})"
                 for name in METHODS[1:]]
        lines.append(
            f"| {row['world']} | {_fmt_params(row['numel'])} | {row['tensors']} | "
            f"{row['numel'] * 4 / 1e6:.0f} | {m['raw'] * 1e3:.1f} ({r0['raw'] * 1e3:.1f}) | "
            + " | ".join(cells) + " |")
    lines += ["", "Per-method median and [min, max] over reps (ms, max over ranks):", ""]
    lines += ["| world | params | " + " | ".join(METHODS) + " |",
              "|---:|---:|" + "---:|" * len(METHODS)]
    for row in rows:
        cells = [f"{med(row['max'][n]) * 1e3:.1f} [{min(row['max'][n]) * 1e3:.1f}, "
                 f"{max(row['max'][n]) * 1e3:.1f}]" for n in METHODS]
        lines.append(f"| {row['world']} | {_fmt_params(row['numel'])} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


def _parse_list(text: str, cast) -> list:
    return [cast(float(x)) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,5e7", help="fp32 parameters per model")
    parser.add_argument("--worlds", default="2,4", help="numbers of worker processes")
    parser.add_argument("--reps", type=int, default=40, help="timed calls per method")
    parser.add_argument("--out", default="experiments/bench_averaging.md")
    parser.add_argument("--timeout", type=float, default=600.0, help="gloo/store timeout (s)")
    args = parser.parse_args(argv)
    sizes = _parse_list(args.sizes, int)
    worlds = _parse_list(args.worlds, int)
    argv_shown = sys.argv[1:] if argv is None else argv
    command = " ".join(["python", "experiments/bench_averaging.py", *argv_shown])
    start = time.perf_counter()
    rows = []
    for world in worlds:
        rows += run_world(world, sizes, args.reps, args.timeout)
        print(f"world {world} done after {time.perf_counter() - start:.0f} s", flush=True)
    text = render(rows, command, args.reps, time.perf_counter() - start)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()

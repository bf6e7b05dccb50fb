"""Suite items 1, 2 and part of 5: what one model average costs, relative to one raw all-reduce.

For each world size and model size, the workers time these side by side in the same processes,
interleaved round-robin across repetitions (so noise hits all of them alike), with a
`dist.barrier()` before each timed call:

  raw         one `dist.all_reduce` of a preallocated flat fp32 buffer of the same size (the limit)
  ours        `PeriodicAverager(model, period=1).average()`: in place over a persistent flat
              buffer, `div_` then one all-reduce (on gloo)
  bucketed    the same flat buffer divided and all-reduced in ~4 MB buckets, all in flight
              together (an alternative we measured and did not adopt)
  torch       `torch.distributed.algorithms.model_averaging.utils.average_parameters`
  per-tensor  one `all_reduce` per parameter tensor, then a division (the seed's way)
  raw-bf16    one all-reduce of a persistent bf16 buffer of as many elements (item 2's limit)
  raw-fp16    the same in fp16

A rep's time for a method is the max over ranks; tables give medians over reps. After the warm-up
each method's fresh allocations are measured once as the rise of peak RSS above the RSS before the
call (VmHWM reset through /proc/self/clear_refs): a model-size number means a model-size
allocation per sync.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from experiments.bench.common import fmt_params, median, rotated, run_world, transient_mib
from localsgd.averaging import PeriodicAverager

BUCKET_ELEMENTS = 1 << 20  # 4 MB of fp32
METHODS = ("raw", "ours", "bucketed", "torch", "per-tensor", "raw-bf16", "raw-fp16")
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
            params.append(nn.Parameter(torch.rand(shape, generator=g)))
            params.append(nn.Parameter(torch.rand(rows, generator=g)))
        self.params = nn.ParameterList(params)


def _per_tensor(params: list[torch.Tensor], group, world_size: int) -> None:
    for p in params:
        dist.all_reduce(p.data, group=group)
        p.data.div_(world_size)


def _bench_size(target: int, reps: int, world_size: int) -> dict:
    group = dist.group.WORLD
    model_ours, model_torch, model_naive = Blob(target), Blob(target), Blob(target)
    numel = sum(p.numel() for p in model_ours.parameters())
    n_tensors = len(list(model_ours.parameters()))
    averager = PeriodicAverager(model_ours, period=1, process_group=group)
    bucketed = PeriodicAverager(Blob(target), period=1, process_group=group)
    bucketed_flat = bucketed.flat.buffers[0]
    # Values in [0, 1): summing without dividing grows them by world_size per call, so the raw
    # buffers are rescaled every few reps (outside the timed calls) to stay far from overflow.
    raw = {dt: torch.rand(numel).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    naive_params = list(model_naive.parameters())

    def bucketed_average():
        works = []
        for bucket in bucketed_flat.split(BUCKET_ELEMENTS):
            bucket.div_(world_size)
            works.append(dist.all_reduce(bucket, group=group, async_op=True))
        for work in works:
            work.wait()

    calls = {
        "raw": lambda: dist.all_reduce(raw[torch.float32], group=group),
        "ours": averager.average,
        "bucketed": bucketed_average,
        "torch": lambda: average_parameters(model_torch.parameters(), group),
        "per-tensor": lambda: _per_tensor(naive_params, group, world_size),
        "raw-bf16": lambda: dist.all_reduce(raw[torch.bfloat16], group=group),
        "raw-fp16": lambda: dist.all_reduce(raw[torch.float16], group=group),
    }
    transient = {}
    for name in METHODS:  # warm-up: first-touch page faults, gloo's connection buffers
        dist.barrier()
        calls[name]()
    for name in METHODS:
        dist.barrier()
        transient[name] = transient_mib(calls[name])
    for buf in raw.values():
        buf.fill_(0.5)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for rep in range(reps):
        for name in rotated(METHODS, rep):
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
        if rep % 4 == 3:
            for buf in raw.values():
                buf.fill_(0.5)
    return {
        "target": target,
        "numel": numel,
        "tensors": n_tensors,
        "times": times,
        "transient_mib": transient,
    }


def _worker(rank: int, world_size: int, sizes: list[int], reps: int) -> list[dict]:
    results = []
    for n in sizes:
        results.append(_bench_size(n, reps, world_size))
        gc.collect()  # the models of this size are gone before the next is built
    return results


def run(worlds: list[int], sizes: list[int], reps: int, timeout_s: float) -> list[dict]:
    """One row per (world, size): per method the per-rep times, max over ranks (seconds)."""
    rows = []
    for world in worlds:
        per_rank = run_world(_worker, world, sizes, reps, timeout_s=timeout_s)
        for i, first in enumerate(per_rank[0]):
            row = {
                "world": world,
                "numel": first["numel"],
                "tensors": first["tensors"],
                "transient_mib": first["transient_mib"],
                "max": {
                    name: [max(r[i]["times"][name][k] for r in per_rank) for k in range(reps)]
                    for name in METHODS
                },
            }
            rows.append(row)
    return rows


def render(rows: list[dict], reps: int) -> list[str]:
    lines = [
        "## 1-2. Averaging cost, as a ratio to one raw fp32 all-reduce of the same elements",
        "",
        f"{reps} reps per method after one warm-up call; methods interleaved round-robin (first "
        "method rotated each rep), `dist.barrier()` before each timed call; a rep's time is the "
        "max over ranks; ratio = median / raw's median. Targets: ours <= 1.05x at 10M and 50M; "
        "compressed <= 0.6x.",
        "",
        "| world | params | tensors | raw ms | " + " | ".join(f"{m} x" for m in METHODS[1:]) + " |",
        "|---:|---:|---:|---:|" + "---:|" * (len(METHODS) - 1),
    ]
    for row in rows:
        med = {name: median(row["max"][name]) for name in METHODS}
        cells = [f"{med[name] / med['raw']:.2f}" for name in METHODS[1:]]
        lines.append(
            f"| {row['world']} | {fmt_params(row['numel'])} | {row['tensors']} | "
            f"{med['raw'] * 1e3:.1f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "Spread: median [min, max] over reps, ms (max over ranks):",
        "",
        "| world | params | " + " | ".join(METHODS) + " |",
        "|---:|---:|" + "---:|" * len(METHODS),
    ]
    for row in rows:
        cells = [
            f"{median(row['max'][n]) * 1e3:.1f} [{min(row['max'][n]) * 1e3:.1f}, "
            f"{max(row['max'][n]) * 1e3:.1f}]"
            for n in METHODS
        ]
        lines.append(f"| {row['world']} | {fmt_params(row['numel'])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Fresh memory per call (rank 0; peak RSS rise above the RSS before one call, MiB; the "
        "model is `fp32 MiB`):",
        "",
        "| world | params | fp32 MiB | " + " | ".join(METHODS) + " |",
        "|---:|---:|---:|" + "---:|" * len(METHODS),
    ]
    for row in rows:
        cells = [
            "n/a" if row["transient_mib"][n] is None else f"{row['transient_mib'][n]:.1f}"
            for n in METHODS
        ]
        lines.append(
            f"| {row['world']} | {fmt_params(row['numel'])} | {row['numel'] * 4 / 2**20:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines

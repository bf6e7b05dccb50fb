"""Suite items 1, 2 and part of 5: what one model average costs, relative to one raw all-reduce.

For each world size and model size, the workers time these side by side in the same processes,
interleaved round-robin across repetitions (so noise hits all of them alike), with a
`dist.barrier()` before each timed call:

fp32 (item 1)
  raw         one `dist.all_reduce` (SUM) of a preallocated flat fp32 buffer of the same size
              (the limit)
  ours        `PeriodicAverager(1, module=model).average()`: in place over a persistent flat
              buffer, `div_` then one all-reduce (on gloo), with the default NaN/Inf guard
              (`localsgd.averaging.finite`: a finiteness pass before, a canary read after)
  unguarded   the same with `drop_nonfinite=False`: what the guard costs is ours / unguarded
  gloo-avg    one `dist.all_reduce(op=ReduceOp.AVG)` of the raw fp32 buffer: gloo's own average,
              which runs a division pass itself (what separates any average from a raw sum)
  bucketed    the same flat buffer divided and all-reduced in ~4 MB buckets, all in flight
              together (an alternative we measured and did not adopt)
  torch       `torch.distributed.algorithms.model_averaging.utils.average_parameters`
  per-tensor  one `all_reduce` per parameter tensor, then a division (the seed's way)
low precision (item 2)
  raw-bf16    one all-reduce of a persistent bf16 buffer of as many elements (the limit)
  ours-bf16   `PeriodicAverager(..., comm_dtype=torch.bfloat16).average()`: the change since the
              last sync, communicated in bf16 (localsgd/averaging/wire/compress.py)
  raw-fp16, ours-fp16   the same in fp16
hierarchical (world 4 only: levels {period 1: groups of 2, period 2: all 4})
  hier-world        `HierarchicalAverager.maybe_average()` at a step where the world level averages
  torch-hier-world  torch's `HierarchicalModelAverager.average_parameters()`, the same step
  hier-pair, torch-hier-pair   the same at a step where only the 2-rank groups average
Before timing, each hierarchical call is checked to average over the intended group (every rank
starts from its rank number and must end at its group's mean), and afterwards our averager's
per-level round counts must match the calls made; the low-precision averagers must have counted
2 bytes per element.

A rep's time for a method is the max over ranks; tables give medians over reps, as ratios to
raw (the fp32 all-reduce over the whole world, also for the 2-rank level). After the warm-up
each method's fresh allocations are measured once as the rise of peak RSS above the RSS before the
call (VmHWM reset through /proc/self/clear_refs): a model-size number means a model-size
allocation per sync.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from experiments.bench.common import fmt_params, median, rotated, run_world, transient_mib
from localsgd.averaging import HierarchicalAverager, PeriodicAverager

BUCKET_ELEMENTS = 1 << 20  # 4 MB of fp32
FP32_METHODS = ("raw", "ours", "unguarded", "gloo-avg", "bucketed", "torch", "per-tensor")
LOW_METHODS = ("raw-bf16", "ours-bf16", "raw-fp16", "ours-fp16")
HIER_METHODS = ("hier-world", "torch-hier-world", "hier-pair", "torch-hier-pair")
METHODS = FP32_METHODS + LOW_METHODS + HIER_METHODS
HIER_WORLD = 4
HIER_LEVELS = OrderedDict([(1, 2), (2, 4)])  # period -> group size
HIER_STEP = {"world": 0, "pair": 1}  # a step index at which that level (alone) averages
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


def _hierarchical_calls(target: int, world_size: int, torch_params: list[torch.Tensor]) -> dict:
    """The timed hierarchical calls, each checked to average over the intended group."""
    ours = HierarchicalAverager(HIER_LEVELS, module=Blob(target))
    theirs = HierarchicalModelAverager(HIER_LEVELS)
    # torch's averages only parameters that have a `.grad` (as after a backward pass); a
    # zero-stride placeholder gives them one without allocating a model-size gradient.
    for p in torch_params:
        p.grad = torch.zeros(()).expand_as(p)

    def ours_at(step: int):
        ours.step = step
        ours.maybe_average()

    def theirs_at(step: int):
        theirs.step = step
        theirs.average_parameters(torch_params)

    calls = {}
    rank = dist.get_rank()
    for level, step in HIER_STEP.items():
        size = world_size if level == "world" else HIER_LEVELS[1]
        expected = rank // size * size + (size - 1) / 2  # the mean of the group's rank numbers
        for name, call, tensors in (
            (f"hier-{level}", lambda s=step: ours_at(s), ours.flat.buffers),
            (f"torch-hier-{level}", lambda s=step: theirs_at(s), torch_params),
        ):
            for t in tensors:
                t.data.fill_(float(rank))
            call()
            if not all(bool((t == expected).all()) for t in tensors):
                raise RuntimeError(f"{name} did not average over its {size}-rank group")
            calls[name] = call
    return calls, ours


def _bench_size(target: int, reps: int, world_size: int) -> dict:
    group = dist.group.WORLD
    model_ours, model_torch, model_naive = Blob(target), Blob(target), Blob(target)
    numel = sum(p.numel() for p in model_ours.parameters())
    n_tensors = len(list(model_ours.parameters()))
    averager = PeriodicAverager(1, process_group=group, module=model_ours)
    unguarded = PeriodicAverager(1, process_group=group, module=Blob(target), drop_nonfinite=False)
    low_averagers = {
        dt: PeriodicAverager(1, process_group=group, module=Blob(target), comm_dtype=dt)
        for dt in (torch.bfloat16, torch.float16)
    }
    bucketed = PeriodicAverager(1, process_group=group, module=Blob(target))
    bucketed_flat = bucketed.flat.buffers[0]
    # Values in [0, 1): summing without dividing grows them by world_size per call, so the raw
    # buffers are rescaled every few reps (outside the timed calls) to stay far from overflow.
    raw = {dt: torch.rand(numel).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    naive_params = list(model_naive.parameters())
    torch_params = list(model_torch.parameters())

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
        "unguarded": unguarded.average,
        "gloo-avg": lambda: dist.all_reduce(raw[torch.float32], op=dist.ReduceOp.AVG, group=group),
        "bucketed": bucketed_average,
        "torch": lambda: average_parameters(torch_params, group),
        "per-tensor": lambda: _per_tensor(naive_params, group, world_size),
        "raw-bf16": lambda: dist.all_reduce(raw[torch.bfloat16], group=group),
        "ours-bf16": low_averagers[torch.bfloat16].average,
        "raw-fp16": lambda: dist.all_reduce(raw[torch.float16], group=group),
        "ours-fp16": low_averagers[torch.float16].average,
    }
    hier = None
    if world_size == HIER_WORLD:  # torch's averager shares torch's model: neither keeps state
        hier_calls, hier = _hierarchical_calls(target, world_size, torch_params)
        calls.update(hier_calls)
    methods = tuple(name for name in METHODS if name in calls)
    transient = {}
    for name in methods:  # warm-up: first-touch page faults, gloo's connection buffers
        dist.barrier()
        calls[name]()
    for name in methods:
        dist.barrier()
        transient[name] = transient_mib(calls[name])
    for buf in raw.values():
        buf.fill_(0.5)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for rep in range(reps):
        for name in rotated(methods, rep):
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
        if rep % 4 == 3:
            for buf in raw.values():
                buf.fill_(0.5)
    for dt, low in low_averagers.items():  # the compressed path really ran, at 2 bytes/element
        if low.level_stats[0].bytes != low.level_stats[0].rounds * numel * dt.itemsize:
            raise RuntimeError(f"the averager with comm_dtype={dt} did not communicate in it")
    hier_rounds = None
    if hier is not None:  # per level: the check, the warm-up, the memory reading, the reps
        hier_rounds = [lv["rounds"] for lv in hier.comm_levels()]
        if hier_rounds != [reps + 3, reps + 3]:
            raise RuntimeError(f"hierarchical per-level rounds {hier_rounds}, not {reps + 3} each")
    return {
        "target": target,
        "numel": numel,
        "tensors": n_tensors,
        "times": times,
        "transient_mib": transient,
        "hier_rounds": hier_rounds,
    }


def _worker(rank: int, world_size: int, sizes: list[int], reps: int) -> list[dict]:
    results = []
    for n in sizes:
        results.append(_bench_size(n, reps, world_size))
        gc.collect()  # the models of this size are gone before the next is built
    return results


def run(worlds: list[int], sizes: list[int], reps: int, timeout_s: float) -> list[dict]:
    """One row per (world, size): per method timed there, the per-rep times, max over ranks (s)."""
    rows = []
    for world in worlds:
        per_rank = run_world(_worker, world, sizes, reps, timeout_s=timeout_s)
        for i, first in enumerate(per_rank[0]):
            row = {
                "world": world,
                "numel": first["numel"],
                "tensors": first["tensors"],
                "transient_mib": first["transient_mib"],
                "hier_rounds": first["hier_rounds"],
                "max": {
                    name: [max(r[i]["times"][name][k] for r in per_rank) for k in range(reps)]
                    for name in first["times"]
                },
            }
            rows.append(row)
    return rows


def _ratio_table(rows: list[dict], methods: tuple[str, ...], tensors: bool) -> list[str]:
    lead = "| world | params | " + ("tensors | " if tensors else "") + "raw ms | "
    lines = [
        lead + " | ".join(f"{m} x" for m in methods) + " |",
        "|---:|---:|" + ("---:|" if tensors else "") + "---:|" + "---:|" * len(methods),
    ]
    for row in rows:
        med = {name: median(ts) for name, ts in row["max"].items()}
        cells = [f"{med[m] / med['raw']:.2f}" if m in med else "n/a" for m in methods]
        lines.append(
            f"| {row['world']} | {fmt_params(row['numel'])} | "
            + (f"{row['tensors']} | " if tensors else "")
            + f"{med['raw'] * 1e3:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _per_method_table(rows: list[dict], cell) -> list[str]:
    """One row per method, one column per (world, size): `cell(row, method)` or n/a."""
    lines = [
        "| method | " + " | ".join(f"w{r['world']} {fmt_params(r['numel'])}" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for m in METHODS:
        cells = [cell(r, m) if m in r["max"] else "n/a" for r in rows]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _spread(row: dict, m: str) -> str:
    ts = row["max"][m]
    return f"{median(ts) * 1e3:.1f} [{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]"


def _fresh(row: dict, m: str) -> str:
    mib = row["transient_mib"][m]
    return "n/a" if mib is None else f"{mib:.1f}"


def render(rows: list[dict], reps: int) -> list[str]:
    lines = [
        "## 1-2. Averaging cost, as a ratio to one raw fp32 all-reduce of the same elements",
        "",
        f"{reps} reps per method after one warm-up call; methods interleaved round-robin (first "
        "method rotated each rep), `dist.barrier()` before each timed call; a rep's time is the "
        "max over ranks; ratio = median / raw's median (raw: the fp32 SUM all-reduce over the "
        "whole world). Targets: ours <= 1.05x at 10M and 50M; compressed <= 0.6x.",
        "",
        "fp32 (`gloo-avg`: gloo's own `ReduceOp.AVG`, which divides in a pass of its own):",
        "",
        *_ratio_table(rows, FP32_METHODS[1:], tensors=True),
        "",
        "Low precision (`raw-*`: the all-reduce alone, the limit; `ours-*`: `PeriodicAverager` "
        "with `comm_dtype`, which also subtracts, converts and adds back in fp32):",
        "",
        *_ratio_table(rows, LOW_METHODS, tensors=False),
        "",
        f"Hierarchical, world {HIER_WORLD} only (levels: every step in groups of 2, every 2nd "
        "step all 4): `*-world` times a step at which all 4 average, `*-pair` one at which only "
        "the 2-rank groups do; both as ratios to raw over all 4:",
        "",
        *_ratio_table(rows, HIER_METHODS, tensors=False),
        "",
        "Spread: median [min, max] over reps, ms (max over ranks):",
        "",
        *_per_method_table(rows, _spread),
        "",
        "Fresh memory per call (rank 0; peak RSS rise above the RSS before one call, MiB; the "
        "model in fp32 is "
        + ", ".join(
            f"{n * 4 / 2**20:.1f} MiB at {fmt_params(n)}"
            for n in sorted({r["numel"] for r in rows})
        )
        + "):",
        "",
        *_per_method_table(rows, _fresh),
    ]
    return lines

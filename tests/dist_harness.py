"""Run a function in N gloo worker processes and collect what each returns."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from localsgd.launch import WorkerInfo, init_process_group, spawn


def _entry(info: WorkerInfo, store, fn, args, out_dir, timeout_s) -> None:
    init_process_group(info, "gloo", timeout_s, store)
    try:
        result = fn(info.rank, info.world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{info.rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """`fn(rank, world_size, *args)` in `world_size` processes; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_entry, world_size, timeout_s, args=(fn, args, out_dir, timeout_s))
        return [
            torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


class CollectiveCounter:
    """Counts every torch.distributed collective called through the module's functions."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "barrier",
        "all_to_all",
        "reduce",
        "gather",
        "scatter",
        "broadcast_object_list",
        "all_gather_object",
    )

    def __init__(self):
        self.count = 0
        self._originals = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*a, _original=original, **k):
                self.count += 1
                return _original(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)

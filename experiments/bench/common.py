"""What the benchmark modules share: running a function in N gloo workers, memory readings, and
the description of the machine a table was measured on."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import traceback

import torch
import torch.distributed as dist

from localsgd.launch import WorkerInfo, init_process_group, spawn


def _entry(info: WorkerInfo, store, fn, args, out_dir: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    init_process_group(info, "gloo", timeout_s, store)
    try:
        try:
            result = fn(info.rank, info.world_size, *args)
        except BaseException:
            traceback.print_exc()  # spawn's error names only the last line; show where
            raise
        with open(os.path.join(out_dir, f"{info.rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """`fn(rank, world_size, *args)` in `world_size` fresh gloo processes; per-rank JSON results."""
    with tempfile.TemporaryDirectory() as out_dir:
        spawn(_entry, world_size, timeout_s, args=(fn, args, out_dir, timeout_s))
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                results.append(json.load(f))
        return results


def status_kib(field: str) -> int | None:
    """A `VmRSS`/`VmHWM`-style field of /proc/self/status in KiB (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def transient_mib(call) -> float | None:
    """How far `call()` pushes peak RSS above the RSS before it (MiB): its fresh allocations."""
    if not reset_peak_rss():
        return None
    before = status_kib("VmRSS")
    call()
    peak = status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return (peak - before) / 1024


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_params(n: int) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return str(n)


def rotated(items: tuple, rep: int) -> tuple:
    """The run order of repetition `rep`: each item starts first in turn, so drifting load
    (other jobs starting or ending) hits every item alike."""
    shift = rep % len(items)
    return items[shift:] + items[:shift]


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        model = ""
    return (
        f"{os.cpu_count()} CPUs ({model or platform.processor() or platform.machine()}), "
        f"{platform.platform()}; Python {platform.python_version()}; torch {torch.__version__}; "
        "gloo on CPU (loopback TCP), 1 thread per worker"
    )


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"

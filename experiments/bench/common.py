"""What the benchmark modules share: running a function in N gloo workers, memory readings, and
the description of the machine a table was measured on."""

from __future__ import annotations

import os
import platform
import statistics

import torch

from localsgd.cli.launch import run_on_workers


def run_world(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """`fn(rank, world_size, *args)` in `world_size` fresh gloo processes; per-rank results."""
    return run_on_workers(fn, world_size, *args, timeout_s=timeout_s)


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

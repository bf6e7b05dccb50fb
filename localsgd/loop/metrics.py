"""Rank-0 outputs: per-step metrics as JSON lines and the progress bar."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from tqdm import tqdm


class MetricsWriter:
    """One JSON object per logged step in `metrics.jsonl`, flushed so a crash loses nothing."""

    def __init__(self, path: str, append: bool = False):
        self.path = path
        self.file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def trim_metrics(path: str, last_step: int) -> None:
    """Drop the lines logged after `last_step` (a resumed run redoes those steps), atomically."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, path)


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Write atomically, so a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    # tqdm's default lock holds a multiprocessing semaphore, which a worker leaving by os._exit
    # never releases: the resource tracker then reports it leaked after every run. Each worker
    # draws (at most) its own bar, so a thread lock is all that is needed.
    tqdm.set_lock(threading.RLock())
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        dynamic_ncols=True,
        unit="step",
        desc="train",
        mininterval=0.5,
    )


def rate_record(
    samples: int, interval_s: float, comm_s: float, total_s: float, drift
) -> dict[str, Any]:
    """Throughput (`samples` over all workers in the `interval_s` since the last log line), the
    share of time spent communicating so far, and the mean replica drift over the averages since
    the last log line (from a `DriftMeter`, when there were any)."""
    record = {
        "samples_per_s": round(samples / max(interval_s, 1e-9), 1),
        "comm_share": round(comm_s / max(total_s, 1e-9), 4),
    }
    mean = drift.take() if drift is not None else None
    if mean is not None:
        record["drift"] = mean
    return record

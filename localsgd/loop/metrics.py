"""Rank-0 outputs: per-step metrics as JSON lines, the progress bar and the peak memory on
CUDA; every process's one-line notices."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
from typing import Any

import torch
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


class LoggedBar(tqdm):
    """A progress bar whose last state also goes to the run's train.log when it closes: the
    log holds what the console showed."""

    def close(self) -> None:
        if not self.disable and not getattr(self, "_logged", False):
            self._logged = True
            log_output(str(self))
        super().close()


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train") -> tqdm:
    # tqdm's default lock holds a multiprocessing semaphore, which a worker leaving by os._exit
    # never releases: the resource tracker then reports it leaked after every run. Each worker
    # draws (at most) its own bar, so a thread lock is all that is needed.
    tqdm.set_lock(threading.RLock())
    return LoggedBar(
        total=total,
        initial=initial,
        disable=not enabled,
        dynamic_ncols=True,
        unit="step",
        desc=desc,
        mininterval=0.5,
    )


_notice_log: str | None = None  # this process's run log (`RUN_DIR/train.log`), once known
_bar_elsewhere = False  # whether another process of the run may be drawing a progress bar


def set_notice_log(path: str | None, bar_elsewhere: bool = False) -> None:
    """Where this process's notices are appended besides stderr (Hydra's job log,
    `RUN_DIR/train.log`, which nothing else of ours writes), and whether a progress bar drawn
    by another process (rank 0's, under the launcher) can be on the terminal's last line."""
    global _notice_log, _bar_elsewhere
    _notice_log, _bar_elsewhere = path, bar_elsewhere


def notice(line: str) -> None:
    """One line to stderr that starts a line of its own even while a progress bar is drawn, and
    to the run's `train.log` (with a time, as Hydra's own lines), where it outlives the terminal.

    tqdm.write clears and redraws this process's bars. A bar another process draws ends in no
    newline, so the line would be glued to it: on a terminal the bar's line is erased first
    (the bar redraws itself at its next update), elsewhere (a file, a pipe) a newline ends it."""
    stream = sys.stderr
    own_bar = any(not getattr(bar, "disable", True) for bar in list(tqdm._instances))
    prefix = ""
    if _bar_elsewhere and not own_bar:
        prefix = "\r\x1b[K" if stream.isatty() else "\n"
    # Without a bar here there is nothing to clear, and no lock to take: tqdm's default one is a
    # multiprocessing semaphore that a process leaving by os._exit would leak (`progress_bar`).
    tqdm.write(prefix + line, file=stream, nolock=not own_bar)
    stream.flush()
    if _notice_log is None:
        return
    _append(line, "NOTICE")


def log_output(text: str) -> None:
    """`text`, which the console showed, into the run's train.log too (each of its lines)."""
    if _notice_log is not None:
        _append(text, "OUTPUT")


def _append(text: str, level: str) -> None:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    lines = "".join(f"[{now}][localsgd][{level}] - {line}\n" for line in text.splitlines())
    try:  # one write, appended: processes of a run share the file without a lock
        with open(_notice_log, "a", encoding="utf-8") as f:
            f.write(lines)
    except OSError:  # the log is a copy; the console has the line
        pass


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


class PeakMemory:
    """On CUDA, the most bytes the caching allocator handed out (`torch.cuda.
    max_memory_allocated`: tensors, activations, FSDP's gathered units, NCCL's buffers; not the
    cache it keeps): `interval()` the peak since the last call, for a metrics line, `run()` the
    whole run's, for the summary. Elsewhere nothing: the key is absent, not zero (CPU memory
    has no such counter; `state_bytes` counts the training state on any device)."""

    KEY = "peak_allocated_bytes"

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.run_peak = 0
        if self.cuda:  # from here on: the model and the averager are built, training starts
            torch.cuda.reset_peak_memory_stats(device)

    def _take(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        self.run_peak = max(self.run_peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def interval(self) -> dict[str, int]:
        return {self.KEY: self._take()} if self.cuda else {}

    def run(self) -> dict[str, int]:
        if not self.cuda:
            return {}
        self._take()
        return {self.KEY: self.run_peak}

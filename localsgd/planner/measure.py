"""Measure a job on this machine: a few real steps of every worker, the model, and the link.

`measure_worker` runs in each of the job's worker processes (spawned by the launcher the CLI
uses): it builds the job's own `Trainer` (its data, model, optimizer and recipe) with
communication off, times `steps` optimizer steps through `Trainer.train_step` (its
`compute_s`: the steps less any communication; each step's time is kept, for the barrier's
jitter), then, if asked, probes the link with timed
all-reduces and all-gathers between the workers, and writes what it found to
`out/rank{r}.json` (rank 0 adds the model's shape). `StepClock` is the same clock as a trainer
callback, for real runs (experiments/plan_check/).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from localsgd.planner.model import Link
from localsgd.planner.sizes import ModelShape

PROBE_REPS = 5  # timed repetitions of each probe collective (the median is kept)


def _write(out: str, rank: int, record: dict) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def measure_worker(info, store, cfg, out: str, steps: int, skip: int, probe: bool) -> None:
    """One worker of the measurement (`localsgd.cli.launch.spawn` calls it)."""
    from localsgd.cli.launch import init_process_group, pick_backend, pick_device
    from localsgd.loop.metrics import progress_bar
    from localsgd.loop.trainer import Trainer

    device = pick_device(cfg.dist.device, info.local_rank)
    store = init_process_group(
        info, pick_backend(cfg.dist.backend, device), cfg.dist.timeout_s, store
    )
    try:
        trainer = Trainer(cfg, info, device, out, store=store)
        main = info.rank == 0
        total = steps + (3 * PROBE_REPS if probe else 0)
        bar = progress_bar(total, 0, main, desc="plan: timing your job's steps")
        times = []
        for step in range(steps):
            before = trainer.compute_s
            trainer.train_step(step)
            if step >= skip:  # the first steps allocate and warm caches: not timed
                times.append(trainer.compute_s - before)
            bar.update(1)
        record = {"rank": info.rank, "step_s": sum(times) / len(times), "step_times": times}
        if main:
            record["shape"] = ModelShape.of(trainer.model).to_dict()
        if probe:
            bar.set_description("plan: probing the link")
            payload = 4 * max(
                1 << 18, min(sum(p.numel() for p in trainer.model.parameters()), 1 << 24)
            )
            record["link"] = probe_link(payload, device, bar.update)
        bar.close()
        _write(out, info.rank, record)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _timed(fn, reps: int, tick) -> float:
    """The median seconds of `fn()` over `reps` runs, each started together on every rank."""
    fn()  # the first call sets up gloo's buffers and connections
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        tick(1)
    return statistics.median(times)


def probe_link(nbytes: int, device: torch.device, tick=lambda n: None) -> dict:
    """The link between the workers: a one-value all-reduce's time (the latency), then an
    all-reduce and an all-gather of `nbytes` per worker (their payload rates)."""
    tiny = torch.zeros(1, device=device)
    latency = _timed(lambda: dist.all_reduce(tiny), PROBE_REPS, tick)
    big = torch.zeros(nbytes // 4, device=device)
    reduce_s = _timed(lambda: dist.all_reduce(big), PROBE_REPS, tick)
    msg = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(nbytes * dist.get_world_size(), dtype=torch.uint8, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_s = _timed(lambda: gather(out, msg), PROBE_REPS, tick)

    def gbps(seconds: float) -> float:
        return nbytes * 8 / max(seconds - latency, 1e-6) / 1e9

    return {
        "latency_s": latency,
        "bandwidth_gbps": gbps(reduce_s),
        "gather_gbps": gbps(gather_s),
        "probe_bytes": nbytes,
        "reduce_s": reduce_s,
        "gather_s": gather_s,
    }


def link_of(probe: dict) -> Link:
    return Link(probe["latency_s"], probe["bandwidth_gbps"], probe["gather_gbps"])


class StepClock:
    """A trainer callback (`trainer.callbacks=[{_target_:localsgd.planner.measure.StepClock,
    out:DIR}]`): after every step it notes this rank's compute seconds so far
    (`Trainer.compute_s`) and its training loop's seconds; after the last step each rank writes
    them, with its seconds inside collectives, to `DIR/rank{r}.json`."""

    def __init__(self, out: str):
        self.out = out
        self.compute: list[float] = []
        self.wall: list[float] = []

    def on_step_end(self, trainer, step: int) -> None:
        self.compute.append(round(trainer.compute_s, 6))
        self.wall.append(round(trainer.elapsed(), 6))
        if step + 1 != trainer.cfg.trainer.max_steps:
            return
        os.makedirs(self.out, exist_ok=True)
        _write(
            self.out,
            trainer.info.rank,
            {
                "rank": trainer.info.rank,
                "compute_s": trainer.compute_s,
                "wall_s": trainer.elapsed(),
                "steps": step + 1,
                "comm_s": trainer.comm_stats.seconds,
                "compute_trace": self.compute,
                "wall_trace": self.wall,
            },
        )

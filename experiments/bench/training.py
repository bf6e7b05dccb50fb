"""Suite items 3, 4 and 5: the real trainer's throughput against k, its overhead against a
hand-written torch loop, and a worker's peak memory with and without averaging.

Throughput runs `Trainer.train()` (the loop `python -m localsgd.train` runs: sampler, LR schedule,
loss accounting, logging) for each variant in the same worker processes, a fresh Trainer per run,
the variants interleaved round-robin over repetitions. `off` is `comm.disabled=true`: no
collective after the initial broadcast. `k=K overlap` is the same k with `sync.overlap=true`
(item 6). `hand` is the minimal torch loop below on the same model, data shard, batch indices and
optimizer. The time of a run is its slowest rank's training-loop wall time (the loop alone: no final
average, no evaluation), since a job is done when its last worker is.
"""

from __future__ import annotations

import gc
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from experiments.bench.common import (
    fmt_params,
    median,
    reset_peak_rss,
    rotated,
    run_world,
    status_kib,
)
from localsgd.config import typed
from localsgd.data import ShardSampler, input_shape_of, labels_of, load_data, shard_indices
from localsgd.loop.trainer import Trainer
from localsgd.loop.worker import WorkerInfo
from localsgd.models import build_model

PERIODS = (1, 4, 16, 64)
OVERLAPPED = (1, 4, 16)  # item 6: the same k with sync.overlap=true
VARIANTS = (
    tuple(f"k={k}" for k in PERIODS) + tuple(f"k={k} overlap" for k in OVERLAPPED) + ("off", "hand")
)


def job_overrides(features: int, hidden: list[int], batch: int) -> list[str]:
    """The benchmark's job: an MLP on Gaussian-cluster data, constant LR, no progress bar."""
    return [
        "data=synthetic",
        "data.num_samples=4000",
        f"data.num_features={features}",
        "model=mlp",
        f"model.hidden=[{','.join(map(str, hidden))}]",
        f"trainer.batch_size={batch}",
        "trainer.progress=false",
        "trainer.checkpoint_every=0",  # the hand loop saves nothing either
        "trainer.track_drift=false",  # a diagnostic: one model copy and norm per sync
        "logger.wandb.mode=disabled",
        "optim.lr=0.01",
        "lr_schedule=constant",  # no warmup either
    ]


def _merge(base: dict, delta: dict) -> dict:
    out = dict(base)
    for key, value in delta.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) else value
    return out


def job_config(base: dict, steps: int, variant: str) -> dict:
    cfg = _merge(base, {"trainer": {"max_steps": steps, "eval_every": steps + 1}})
    if variant in ("off", "hand"):  # the hand loop reads only data, model, optim, trainer
        return _merge(cfg, {"comm": {"disabled": True}, "sync": {"warmup_steps": 0}})
    period, _, overlap = variant.removeprefix("k=").partition(" ")
    sync = {"period": int(period), "warmup_steps": 0, "overlap": overlap == "overlap"}
    return _merge(cfg, {"sync": sync})


def _trainer_run(cfg: dict, rank: int, world_size: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        info = WorkerInfo(rank, world_size, rank, world_size)
        trainer = Trainer(typed(cfg), info, torch.device("cpu"), run_dir)
        trainer.train()
        wall = trainer.loop_seconds  # the loop alone: no final average, no evaluation
        del trainer
        gc.collect()
        return wall


def hand_loop(cfg: dict, rank: int, world_size: int) -> float:
    """What a user would write by hand: same model, data shard, batches and optimizer, no comm."""
    data = load_data(cfg["data"], seed=cfg["seed"])
    train_x, train_y = data.train.tensors
    d = cfg["data"]
    shard = shard_indices(
        labels_of(data.train), world_size, rank, d["partition"], seed=cfg["seed"],
        classes_per_worker=d["classes_per_worker"], alpha=d["alpha"],
    )  # fmt: skip
    batches = ShardSampler(shard, cfg["trainer"]["batch_size"], seed=cfg["seed"], rank=rank)
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg["model"], input_shape_of(data), data.num_classes)
    o = cfg["optim"]
    opt = torch.optim.SGD(
        model.parameters(), lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"]
    )
    dist.barrier()  # start together, as the trainer's initial broadcast does
    start = time.perf_counter()
    for _ in range(cfg["trainer"]["max_steps"]):
        idx = batches.next_batch()
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    wall = time.perf_counter() - start
    del model, opt
    gc.collect()
    return wall


def _throughput_worker(rank: int, world_size: int, base: dict, steps: int, reps: int) -> dict:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    # Context: one raw all-reduce of the model's size, against which a step is compared.
    numel = sum(
        p.numel() for p in build_model(
            base["model"], (base["data"]["num_features"],), 10
        ).parameters()
    )  # fmt: skip
    flat = torch.rand(numel)
    reduce_times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        reduce_times.append(time.perf_counter() - start)
        flat.fill_(0.5)
    for rep in range(reps):
        for variant in rotated(VARIANTS, rep):
            cfg = job_config(base, steps, variant)
            if variant == "hand":
                times[variant].append(hand_loop(cfg, rank, world_size))
            else:
                times[variant].append(_trainer_run(cfg, rank, world_size))
    return {"times": times, "numel": numel, "all_reduce_s": median(reduce_times[1:])}


def _memory_worker(rank: int, world_size: int, cfg: dict) -> dict:
    """Peak RSS of a whole worker running the trainer, and RSS growth between the first and last
    step (a per-sync allocation that leaks would show as growth; a transient one in the peak)."""
    with tempfile.TemporaryDirectory() as run_dir:
        info = WorkerInfo(rank, world_size, rank, world_size)
        trainer = Trainer(typed(cfg), info, torch.device("cpu"), run_dir)
        trainer.train_step(0)
        after_first = status_kib("VmRSS")
        reset_peak_rss()  # the peak of the training steps, not of building the data and model
        for step in range(1, cfg["trainer"]["max_steps"]):
            trainer.train_step(step)
        return {
            "peak_kib": status_kib("VmHWM"),
            "rss_first_kib": after_first,
            "rss_last_kib": status_kib("VmRSS"),
            "rounds": trainer.comm_stats.rounds,
        }


def run(base: dict, steps: int, reps: int, memory_steps: int, timeout_s: float) -> dict:
    per_rank = run_world(_throughput_worker, 2, base, steps, reps, timeout_s=timeout_s)
    rank0 = per_rank[0]
    memory = {}
    for variant in ("k=1", "off"):  # fresh processes each, so one peak cannot hide the other
        cfg = job_config(base, memory_steps, variant)
        memory[variant] = run_world(_memory_worker, 2, cfg, timeout_s=timeout_s)[0]
    return {
        "steps": steps,
        "reps": reps,
        "memory_steps": memory_steps,
        "numel": rank0["numel"],
        "all_reduce_s": max(r["all_reduce_s"] for r in per_rank),
        # A job is done when its slowest worker is: a run's time is the max over ranks (without
        # communication nothing holds the ranks together, and rank 0 may finish first).
        "times": {
            v: [max(r["times"][v][i] for r in per_rank) for i in range(reps)] for v in VARIANTS
        },
        "rank0_times": rank0["times"],  # the same runs timed on rank 0 alone, for comparison
        "memory": memory,
        "batch": base["trainer"]["batch_size"],
    }


def render(result: dict) -> list[str]:
    t = result["times"]
    med = {v: median(t[v]) for v in VARIANTS}
    steps = result["steps"]
    step_off = med["off"] / steps
    lines = [
        "## 3. Trainer throughput vs k (2 workers)",
        "",
        f"MLP of {fmt_params(result['numel'])} parameters on synthetic data, batch "
        f"{result['batch']} per worker, {steps} steps per run, {result['reps']} reps, variants "
        "interleaved round-robin; a run's time is its slowest rank's loop. One raw all-reduce of "
        "the model: "
        f"{result['all_reduce_s'] * 1e3:.1f} ms = {result['all_reduce_s'] / step_off:.2f} of a "
        f"no-communication step ({step_off * 1e3:.1f} ms). Target: k=16 >= 0.95x off. "
        "`overlap` rows: `sync.overlap=true` (item 6).",
        "",
        "| variant | steps/s (median) | x off | min-max s per run | x off, rank 0's time |",
        "|---|---:|---:|---:|---:|",
    ]
    r0 = {v: median(result["rank0_times"][v]) for v in VARIANTS}
    for v in VARIANTS[:-1]:
        lines.append(
            f"| {v} | {steps / med[v]:.2f} | {med['off'] / med[v]:.3f} | "
            f"{min(t[v]):.2f}-{max(t[v]):.2f} | {r0['off'] / r0[v]:.3f} |"
        )
    lines += [
        "",
        "The last column times the same runs on rank 0 alone, as earlier versions of this suite "
        "did: without communication rank 0 may finish before the other worker, which flatters "
        "`off`; synchronising workers keeps them together, which is why a rare k can beat `off`.",
    ]
    overhead = med["off"] / med["hand"] - 1
    pairs = [o / h - 1 for o, h in zip(t["off"], t["hand"], strict=True)]
    lines += [
        "",
        "## 4. Framework overhead: trainer with comm off vs a hand-written torch loop",
        "",
        f"Same model, shard, batch indices and SGD, same processes, interleaved. Hand loop: "
        f"{steps / med['hand']:.2f} steps/s; trainer (`comm.disabled=true`): "
        f"{steps / med['off']:.2f} steps/s; trainer slower by **{overhead * 100:+.1f}%** "
        f"(per rep: {', '.join(f'{p * 100:+.1f}%' for p in pairs)}). Target: <= +5%.",
        "",
        "## 5. Worker memory with and without averaging (fresh 2-worker runs)",
        "",
        f"{result['memory_steps']} training steps; peak RSS over the steps after the first (VmHWM "
        "reset after step 0), and RSS after the first and the last step. Model: "
        f"{result['numel'] * 4 / 2**20:.1f} MiB fp32.",
        "",
        "| variant | comm rounds | peak RSS MiB | RSS after first step MiB | after last MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, m in result["memory"].items():
        label = "k=1 (averaging every step)" if variant == "k=1" else "off (no averaging)"
        lines.append(
            f"| {label} | {m['rounds']} | {m['peak_kib'] / 1024:.1f} | "
            f"{m['rss_first_kib'] / 1024:.1f} | {m['rss_last_kib'] / 1024:.1f} |"
        )
    return lines

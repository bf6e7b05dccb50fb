"""Periodic local SGD with `localsgd.averaging` in a plain PyTorch loop: no Hydra, no wandb.

    python examples/averaging_without_hydra.py                # spawns 2 CPU workers (gloo)
    torchrun --nproc-per-node=4 examples/averaging_without_hydra.py

Each worker trains its own copy of a small model on its own data and calls
`averager.average_parameters(...)` after every optimizer step, as with torch's
`PeriodicModelAverager`: every `PERIOD` steps the replicas are replaced by their average. The
script checks that the replicas are bit-identical right after each average and apart between
averages, and exits non-zero otherwise.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from localsgd.averaging import PeriodicAverager

PERIOD = 4
STEPS = 13  # the averager's counter runs 0..12: averages after steps 0, 4, 8 and 12
WORLD_SIZE = 2  # without torchrun


def replicas_identical(model: torch.nn.Module) -> bool:
    """Every rank's parameters gathered and compared bit for bit."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def train(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same initial model on every rank, as DDP would broadcast it
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = PeriodicAverager(period=PERIOD, warmup_steps=0)  # after init_process_group
    assert isinstance(averager, ModelAverager)  # torch's base class: a drop-in

    # each worker its own shard of a regression problem (the data differ, so replicas drift)
    data = torch.Generator().manual_seed(1 + rank)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        x = torch.randn(32, 8, generator=data)
        y = x @ target + 0.1 * torch.randn(32, 1, generator=data)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        averaged = step % PERIOD == 0  # torch's rule with warmup_steps=0
        averager.average_parameters(model.parameters())  # torch's call, after optimizer.step()
        identical = replicas_identical(model)
        if identical != averaged:
            raise SystemExit(f"rank {rank}: step {step}: replicas identical={identical}")
        if rank == 0 and averaged:
            print(f"step {step:2d}  loss {loss.item():.4f}  averaged: replicas identical")
    if rank == 0:
        print(f"{world_size} workers, {STEPS} steps, an average every {PERIOD}: ok")
    dist.barrier()  # nobody tears gloo down while a peer may still be in the last collective


def run(rank: int, world_size: int) -> None:
    try:
        train(rank, world_size)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter teardown: destroying gloo's and the store's native threads at
    # exit aborts a finished worker now and then ("terminate called without an active
    # exception", SIGABRT; 1 run in 11 here), failing a run that succeeded. The trainer's
    # workers do the same (localsgd/cli/launch.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(rank: int, world_size: int, port: int) -> None:
    """One spawned worker: its gloo process group on this machine, then the loop."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    run(rank, world_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun: this process is one rank, the env says which
        dist.init_process_group("gloo")
        run(dist.get_rank(), dist.get_world_size())
    else:
        mp.spawn(worker, args=(WORLD_SIZE, free_port()), nprocs=WORLD_SIZE)

"""`dist.virtual_workers=M`: the job's M workers as threads of the launching process.

Each thread runs the same `run_worker` a spawned process runs, joined in a `virtual` process
group (`localsgd.averaging.virtual`): one worker computes at a time and the reductions add in
gloo's order, so the run gives the bits M gloo processes give, on one core, without M copies of
torch in memory. What needs real processes, several clocks or a GPU is refused here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localsgd.config import ConfigError


def validate_virtual(cfg: Any, get: Callable[[Any, str], Any]) -> None:
    """`dist.virtual_workers`: its value, the world size and device it decides (what else it
    does not combine with is a row of `localsgd.cli.refusals`)."""
    m = get(cfg, "dist.virtual_workers")
    if m is None:
        return
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ConfigError(f"dist.virtual_workers must be an integer >= 1 or null, got {m!r}")
    from localsgd.cli.forkserver import under_torchrun

    if under_torchrun():
        raise ConfigError(
            f"dist.virtual_workers must be null under torchrun (each torchrun rank is a "
            f"process; virtual workers share one), got {m}"
        )
    ws = get(cfg, "dist.world_size")
    if ws is not None and ws != m:
        raise ConfigError(
            f"dist.world_size must be null or {m} with dist.virtual_workers={m} (the virtual "
            f"workers are the whole world), got {ws}"
        )
    for key, value in (("dist.device", "cuda"), ("dist.backend", "nccl")):
        if get(cfg, key) == value:
            raise ConfigError(
                f"{key} must be auto or cpu/gloo with dist.virtual_workers (they run on the "
                f"CPU, with gloo's arithmetic), got {value}"
            )


def spawn_virtual(fn: Callable, world_size: int, timeout_s: float, args: tuple = ()):
    """Run `fn(info, store, *args)` as `world_size` virtual workers (threads of this process
    that share a HashStore); returns the first stop signal this process got (SIGTERM, SIGINT),
    which every worker obeys at an agreed step, or None. A failed worker raises WorkerFailed
    naming its rank, as a failed process does."""
    import torch
    import torch.distributed as dist

    from localsgd.averaging.virtual import run_virtual
    from localsgd.cli.launch import WorkerFailed
    from localsgd.loop.stop import first_signal, install_sigterm_handler
    from localsgd.loop.worker import WorkerInfo

    torch.set_num_threads(1)  # one worker computes at a time: one thread, as each process has
    install_sigterm_handler()  # signals reach the main thread only; the flag is every worker's
    store = dist.HashStore()

    def worker(rank: int, baton, *rest):
        return fn(WorkerInfo(rank, world_size, rank, world_size), store, *rest)

    try:
        run_virtual(worker, world_size, timeout_s, args)
    except Exception as e:  # the first failed worker's error (the others were aborted)
        rank = getattr(e, "virtual_rank", "?")
        last = (str(e).strip().splitlines() or [""])[-1]
        raise WorkerFailed(
            f"worker rank {rank} failed: {type(e).__name__}: {last}", raised=True
        ) from e
    return first_signal()

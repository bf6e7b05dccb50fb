"""What the SIGTERM agreement adds to a sync: one rendezvous-store key check per sync step, as a
ratio to the model average it follows (one all-reduce of the flat fp32 buffer), side by side in
the same 2 gloo processes, interleaved. Also the replica check (`sync.check_replicas=true`).

    python experiments/bench/sync_overhead.py            # ~20 s
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from localsgd.cli.launch import spawn
from localsgd.loop.guards import check_replicas
from localsgd.loop.stop import StopAgreement

SIZES = (10_000, 100_000, 1_000_000)  # fp32 parameters
REPS = 100


def _worker(info, store, out):
    dist.init_process_group("gloo", store=store, rank=info.rank, world_size=info.world_size)
    try:
        stop = StopAgreement(store, "bench")
        for n in SIZES:
            flat = torch.randn(n)
            times = {"all_reduce": [], "store check": [], "check_replicas": []}
            for rep in range(REPS):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(flat)
                times["all_reduce"].append(time.perf_counter() - t)
                t = time.perf_counter()
                stop.after_sync(SIZES.index(n) * REPS + rep)  # a sync step of its own
                times["store check"].append(time.perf_counter() - t)
                flat.fill_(1.0)  # identical on both ranks
                dist.barrier()
                t = time.perf_counter()
                check_replicas([flat], 0, info.rank)
                times["check_replicas"].append(time.perf_counter() - t)
            if info.rank == 0:
                base = statistics.median(times["all_reduce"])
                row = [f"{n:>9,}", f"{base * 1e6:9.0f} us"]
                for k in ("store check", "check_replicas"):
                    row.append(f"{k} {statistics.median(times[k]) / base:6.3f}x")
                print("  ".join(row), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print("params     all_reduce   (median over reps; ratios to that all_reduce)")
    spawn(_worker, 2, 60.0, args=(None,))

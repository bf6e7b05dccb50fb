"""What a sync costs through torchft's quorum (`ft=torchft`) against plain torch.distributed.

In the same 3 worker processes, alternating rep by rep: an average of a flat model through
`PeriodicAverager.average()` on the 3-rank gloo group, and the same average as a torchft round
(`FaultTolerantRounds.average()` over 3 single-process replica groups on 127.0.0.1: quorum, a
one-value count, the average, should_commit, the snapshot a rollback would restore). Reports the
median time of each and their ratio per model size; the ratio is what the quorum adds.

    python experiments/bench/ft_sync.py            # 1M and 10M floats, 15 reps (~1 min)
    python experiments/bench/ft_sync.py --tiny     # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import machine, median, run_world  # noqa: E402

WORLD = 3


def _measure(rank: int, world_size: int, sizes: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from localsgd.averaging import PeriodicAverager
    from localsgd.averaging.torchft import (
        FaultTolerantRounds,
        TorchftCommunicator,
        make_manager,
        start_lighthouse,
    )

    os.environ.setdefault("RUST_LOG", "warn")
    box = [None]
    server = None
    if rank == 0:
        server, box[0] = start_lighthouse(world_size, quorum_tick_ms=5)
    dist.broadcast_object_list(box, src=0)
    solo = [dist.new_group([r]) for r in range(world_size)][rank]  # this rank alone
    out = {}
    for n in sizes:
        plain_model = torch.nn.Linear(n // 1000, 1000, bias=False)
        ft_model = torch.nn.Linear(n // 1000, 1000, bias=False)
        plain = PeriodicAverager(1, module=plain_model)
        manager = make_manager(replica_id=f"replica_{rank:03d}", lighthouse=box[0])
        ft = FaultTolerantRounds(
            PeriodicAverager(1, module=ft_model, process_group=solo),
            TorchftCommunicator(manager, replicas=world_size),
        )
        ft.start(wait_for=world_size)
        times = {"plain": [], "torchft": []}
        for _ in range(reps + 1):  # the first rep warms up both
            for kind, average in (("plain", plain.average), ("torchft", ft.average)):
                dist.barrier()
                start = time.perf_counter()
                average()
                times[kind].append(time.perf_counter() - start)
        manager.shutdown(wait=False)
        out[n] = {k: v[1:] for k, v in times.items()}
    dist.barrier()
    if server is not None:
        server.shutdown()
    return out


def run(sizes: list[int], reps: int) -> list[dict]:
    per_rank = run_world(_measure, WORLD, sizes, reps)
    rows = []
    for n in sizes:
        # a sync lasts as long as its slowest worker
        slowest = {
            kind: [max(r[n][kind][i] for r in per_rank) for i in range(reps)]
            for kind in ("plain", "torchft")
        }
        plain, ft = median(slowest["plain"]), median(slowest["torchft"])
        rows.append(
            {"floats": n, "plain_ms": plain * 1e3, "torchft_ms": ft * 1e3, "ratio": ft / plain}
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "bench", "FT_SYNC.md"))
    args = parser.parse_args(argv)
    sizes, reps = ([100_000], 3) if args.tiny else ([1_000_000, 10_000_000], 15)
    started = time.perf_counter()
    rows = run(sizes, reps)
    lines = [
        "# A sync through torchft's quorum against plain torch.distributed",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"`python experiments/bench/ft_sync.py{' --tiny' if args.tiny else ''}`, "
        f"{time.perf_counter() - started:.0f} s; {machine()}. {WORLD} workers on one machine, "
        f"gloo over loopback, {reps} alternating reps, the median of each rep's slowest worker.",
        "",
        "| model (fp32 values) | plain average (ms) | torchft round (ms) | ratio |",
        "|---|---|---|---|",
        *(
            f"| {r['floats'] / 1e6:g}M | {r['plain_ms']:.1f} | {r['torchft_ms']:.1f} | "
            f"{r['ratio']:.2f}x |"
            for r in rows
        ),
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

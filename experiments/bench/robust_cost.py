"""What robust aggregation and scoring add to a clean round's wall time, against the mean.

Issue 31's target: on clean runs a robust aggregator costs at most 5% more wall time than the
mean. A whole training run on this shared machine varies more than that from run to run, so
the cost is measured here side by side in the same gloo processes, on the Shakespeare LM the
trust study uses (the 215k-parameter GPT: 4 layers, width 64, context 64, 84 tokens).

Each rep, every rank trains a driver model for H AdamW steps on its own random token batches
(16 x 64, timed: the round's compute) and takes its change. Then each method, in an order
rotated every rep, syncs its own copy of the model moved from its last synced state by that
same change, with `PeriodicAverager(1, module=..., aggregate=..., judge=...).average()`:

  mean          the default: the all-reduced mean (with its NaN/Inf guard)
  clip, trimmed_mean, median
                every rank's change all-gathered, then the rule (`sync.aggregate`)
  mean+score, median+score
                plus the scoring (`sync.score`): the loss on a held-out batch of
                `--score-batch` windows of the anchor, of each contribution and of the
                aggregate (and, in a round whose aggregate gains too little, of the aggregate
                without each one), each evaluation split by samples across the ranks
                (`Judge.batch`, what `sync.score` does)
  mean+score, by candidate
                the same, each contribution evaluated whole by one rank, the anchor and the
                aggregate by every rank (no `Judge.batch`: how sync.score ran before 2026-12-06)

A `dist.barrier()` comes before each timed call and a rep's time is the max over ranks. Per
method it prints the median sync time and the round's extra wall time against the mean,
`(sync - sync_mean) / (compute + sync_mean)`, the median over reps of that ratio computed
within each rep.

    python experiments/bench/robust_cost.py --world 4 --period 10 --reps 8

`--fragments P` times Streaming DiLoCo's blocking fragments instead (`StreamingAverager(P,
fragments=P, outer lr 1, no momentum)`: its `average()` syncs the P fragments in turn, one
period's syncs; the mean is the all-reduced fragments, the others gathered fragment rounds
(`rounds.combine.Gathered`), each fragment scored on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script: make `experiments.bench` importable (and in workers)
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments.bench.common import run_world  # noqa: E402
from localsgd.averaging import Aggregate, Judge, PeriodicAverager, StreamingAverager  # noqa: E402
from localsgd.models.transformer import GPT  # noqa: E402

VOCAB, CONTEXT = 84, 64
METHODS = {  # name: (aggregate rule or None for the all-reduced mean, scored: how)
    "mean": (None, None),
    "clip": ("clip", None),
    "trimmed_mean": ("trimmed_mean", None),
    "median": ("median", None),
    "mean+score": ("mean", "samples"),
    "median+score": ("median", "samples"),
    "mean+score, by candidate": ("mean", "candidate"),
}


def _model() -> GPT:
    torch.manual_seed(0)  # every rank and every method start from the same weights
    return GPT(VOCAB, CONTEXT, d_model=64, n_layers=4, n_heads=4)


def _held_out(model: GPT, batch: int):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randint(VOCAB, (batch, CONTEXT + 1), generator=gen)

    @torch.no_grad()
    def loss_at(round_: int, samples: slice = slice(None)) -> torch.Tensor:
        part = x[samples]
        logits = model(part[:, :-1])
        losses = F.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten(), reduction="none")
        return losses.view(len(part), -1).mean(1).double()

    return loss_at


def _averager(model: GPT, fragments: int, **trust):
    if not fragments:
        return PeriodicAverager(1, module=model, **trust)
    return StreamingAverager(
        fragments,
        module=model,
        fragments=fragments,
        outer_lr=1.0,
        outer_momentum=0.0,
        outer_nesterov=False,
        **trust,
    )


def _worker(
    rank: int, world: int, period: int, reps: int, score_batch: int, fragments: int = 0
) -> dict:
    torch.set_num_threads(1)
    driver = _model()
    optimizer = torch.optim.AdamW(driver.parameters(), lr=2e-3, betas=(0.9, 0.95))
    copies, averagers = {}, {}
    for name, (rule, scored) in METHODS.items():
        model = _model()
        batch = score_batch if scored == "samples" else None
        judge = Judge(_held_out(model, score_batch), batch=batch) if scored else None
        aggregate = Aggregate(rule) if rule is not None else None
        copies[name] = model
        averagers[name] = _averager(model, fragments, aggregate=aggregate, judge=judge)
    gen = torch.Generator().manual_seed(100 + rank)
    times: dict[str, list[float]] = {"compute": [], **{m: [] for m in METHODS}}
    names = list(METHODS)
    for rep in range(reps + 1):  # rep 0 warms up
        start = [p.detach().clone() for p in driver.parameters()]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(period):
            x = torch.randint(VOCAB, (16, CONTEXT + 1), generator=gen)
            loss = F.cross_entropy(driver(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        compute = time.perf_counter() - t0
        change = [p.detach() - s for p, s in zip(driver.parameters(), start, strict=True)]
        order = names[rep % len(names) :] + names[: rep % len(names)]
        took = {}
        for name in order:
            with torch.no_grad():
                for p, d in zip(copies[name].parameters(), change, strict=True):
                    p.add_(d)
            dist.barrier()
            t0 = time.perf_counter()
            averagers[name].average()
            took[name] = time.perf_counter() - t0
        with torch.no_grad():  # the driver continues from the mean, as every copy's anchor
            for p, q in zip(driver.parameters(), copies["mean"].parameters(), strict=True):
                p.copy_(q)
        if rep:
            times["compute"].append(compute)
            for name in names:
                times[name].append(took[name])
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--period", type=int, default=10, help="H: inner steps a round")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--score-batch", type=int, default=256)
    parser.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="P > 0: Streaming DiLoCo's blocking fragments (see the doc)",
    )
    args = parser.parse_args()
    per_rank = run_world(
        _worker,
        args.world,
        args.period,
        args.reps,
        args.score_batch,
        args.fragments,
        timeout_s=1800,
    )
    reps = len(per_rank[0]["compute"])
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(reps)] for k in per_rank[0]}
    compute = slowest["compute"]
    for name in METHODS:
        extra = [
            (slowest[name][i] - slowest["mean"][i]) / (compute[i] + slowest["mean"][i])
            for i in range(reps)
        ]
        print(
            json.dumps(
                {
                    "world": args.world,
                    "period": args.period,
                    "fragments": args.fragments,
                    "method": name,
                    "sync_ms": round(statistics.median(slowest[name]) * 1e3, 1),
                    "compute_ms": round(statistics.median(compute) * 1e3, 1),
                    "extra_wall_vs_mean": round(statistics.median(extra), 4),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

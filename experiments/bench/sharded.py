"""Sharded against replicated DiLoCo at nanoGPT's GPT-2 small shape, 4 CPU processes.

The same 4 worker processes' job twice, one after the other in one invocation: as 4 replicas
(each the whole model, `dist.shard_size=1`) and as 2 replica groups of 2 ranks (FSDP2 inside,
`dist.shard_size=2`). Each runs a few DiLoCo steps (inner AdamW, the outer Nesterov step every
`--period` steps) on random tokens, then reports rank 0's state (`localsgd.loop.fsdp.
state_bytes`: parameters, gradients, AdamW's moments, the averager's anchor and outer momentum)
and the time of one blocking averaging round (`averager.average()`: the pseudo-gradient's
all-reduce and the outer step), the median over `--rounds`, the slowest rank's. Then, in the
same processes, the same rounds again with the anchor and outer momentum in host memory
(`sync.outer_state=cpu`, a new averager over the same model): the outer step's cost with and
without the option, side by side. On a CPU machine the host *is* the device, so that ratio
measures the option's extra copies only; the copies over PCIe need a GPU
(experiments/gpu_check/gpu_check.py).

    python experiments/bench/sharded.py               # GPT-2 small (124M), ~4 min, ~14 GB
    python experiments/bench/sharded.py --tiny        # smoke test, seconds

Writes experiments/bench/SHARDED.md (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import machine, median, run_world  # noqa: E402

WORLD = 4
GPT2_SMALL = {"vocab": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12}
TINY = {"vocab": 256, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _job(rank: int, world_size: int, shape: dict, shard_size: int, args: dict) -> dict:
    import torch

    from localsgd.averaging import OuterAverager
    from localsgd.loop.fsdp import Sharding, state_bytes
    from localsgd.models.transformer import GPT

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model everywhere
    sharding = Sharding(shard_size, world_size, torch.device("cpu"))
    model = GPT(shape["vocab"], args["seq"], shape["d_model"], shape["n_layers"], shape["n_heads"])
    params = sum(p.numel() for p in model.parameters())
    model = sharding.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1)
    averager = OuterAverager(args["period"], process_group=sharding.replicate_group, module=model)
    # the state at its peak in a round: taken just before the mirror is pushed back and
    # released (sharded: the mirrored copy of the shards exists only then)
    peak = {"total": 0}
    push = averager.flat.push

    def measured_push() -> None:
        at_round = state_bytes(model, opt, averager)["total"]
        peak["total"] = max(peak["total"], at_round)
        push()

    averager.flat.push = measured_push
    gen = torch.Generator().manual_seed(rank)
    step_s = []
    for _ in range(args["steps"]):
        x = torch.randint(shape["vocab"], (1, args["seq"] + 1), generator=gen)
        start = time.perf_counter()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=False)  # gradients held, as in the measured state
        loss.backward()
        opt.step()
        averager.maybe_average()
        step_s.append(time.perf_counter() - start)
    rounds = _rounds(averager, args["rounds"])
    out = {
        "params": params,
        "state": state_bytes(model, opt, averager),
        "state_at_round": max(peak["total"], state_bytes(model, opt, averager)["total"]),
        "round_s": rounds,
        "step_s": step_s,
        "sent": averager.stats.bytes,
        "loss": float(loss.detach()),
    }
    # sync.outer_state device against cpu, side by side: the averager above, the gradients and
    # AdamW's moments dropped first (no round reads them; 4 x 1 of GPT-2 small would not fit
    # this machine's 24 GiB beside a second averager otherwise). Then, twice in turn, a fresh
    # averager of each kind over the averaged model: one round untimed (its first outer step
    # allocates the momentum, first touches), then `rounds` timed.
    averager.flat.push = push  # no cycle through the closure: freed at once
    averager = None
    opt.state.clear()
    for p in model.parameters():
        p.grad = None
    gc.collect()
    out["side_by_side_s"] = {"device": [], "cpu": []}
    for _ in range(2):
        for where, timed in out["side_by_side_s"].items():
            fresh = OuterAverager(
                args["period"], process_group=sharding.replicate_group, module=model,
                outer_state=where,
            )  # fmt: skip
            timed.extend(_rounds(fresh, 1 + args["rounds"])[1:])
            if where == "cpu":
                out["host_state"] = state_bytes(model, opt, fresh)
            fresh = None
            gc.collect()
    return out


def _rounds(averager, n: int) -> list[float]:
    """Seconds of `n` blocking averaging rounds (the pseudo-gradient's all-reduce and the outer
    step), each started together on every rank."""
    import torch

    out = []
    for _ in range(n):
        torch.distributed.barrier()
        start = time.perf_counter()
        averager.average()
        out.append(time.perf_counter() - start)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model: a smoke test")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--period", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "bench", "SHARDED.md"))
    args = parser.parse_args(argv)
    shape = TINY if args.tiny else GPT2_SMALL
    job = {"steps": args.steps, "period": args.period, "rounds": args.rounds, "seq": args.seq}
    started = time.perf_counter()
    results = {}
    rounds = args.rounds
    for shard_size in (1, 2):  # one after the other: the two never share the cores
        ranks = run_world(_job, WORLD, shape, shard_size, job, timeout_s=1800.0)
        results[shard_size] = {
            "rank0": ranks[0],
            "round_s": median([max(r["round_s"][i] for r in ranks) for i in range(args.rounds)]),
            **{
                f"{where}_round_s": median(
                    [max(r["side_by_side_s"][where][i] for r in ranks) for i in range(2 * rounds)]
                )
                for where in ("device", "cpu")
            },
            "step_s": median([max(r["step_s"][i] for r in ranks) for i in range(args.steps)]),
        }
    one, two = results[1], results[2]
    s1, s2 = one["rank0"]["state"], two["rank0"]["state"]
    rows = [
        ("parameters", s1["parameters"], s2["parameters"]),
        ("gradients", s1["gradients"], s2["gradients"]),
        ("AdamW moments", s1["optimizer"], s2["optimizer"]),
        ("averager (anchor, outer momentum)", s1["averager"], s2["averager"]),
        ("total between steps", s1["total"], s2["total"]),
        (
            "total at its peak in a round",
            one["rank0"]["state_at_round"],
            two["rank0"]["state_at_round"],
        ),
    ]
    lines = [
        "# Sharded against replicated DiLoCo: state per rank and one averaging round",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"`python experiments/bench/sharded.py{' --tiny' if args.tiny else ''}`, "
        f"{time.perf_counter() - started:.0f} s; {machine()}. The model: "
        f"{one['rank0']['params'] / 1e6:.1f}M parameters (d_model {shape['d_model']}, "
        f"{shape['n_layers']} layers, {shape['n_heads']} heads, vocabulary {shape['vocab']}, "
        f"context {args.seq}), inner AdamW, DiLoCo's outer step every {args.period} steps, "
        f"{args.steps} steps on random tokens; {WORLD} processes as 4 x 1 (replicated) and "
        f"2 x 2 (FSDP2 inside each group), one after the other.",
        "",
        "| rank 0's state (GiB) | 4 x 1 | 2 x 2 | ratio |",
        "|---|---|---|---|",
        *(f"| {name} | {_gib(a)} | {_gib(b)} | {b / a:.3f} |" for name, a, b in rows if a),
        "",
        "Between steps the averager holds its anchor and outer momentum; sharded, the mirrored "
        "copy of the shards exists only while a step averages (the peak row: taken before it "
        "is pushed back and released). Not counted: activations, FSDP's gathered units.",
        "",
        "| one blocking averaging round (s, median of the slowest rank) | 4 x 1 | 2 x 2 | ratio |",
        "|---|---|---|---|",
        f"| `averager.average()` | {one['round_s']:.3f} | {two['round_s']:.3f} | "
        f"{two['round_s'] / one['round_s']:.2f} |",
        f"| one training step (forward, backward, AdamW) | {one['step_s']:.2f} | "
        f"{two['step_s']:.2f} | {two['step_s'] / one['step_s']:.2f} |",
        "",
        f"Bytes rank 0 sent in the averages: {one['rank0']['sent']:,} (4 x 1) against "
        f"{two['rank0']['sent']:,} (2 x 2).",
        "",
        "## The outer state in host memory (`sync.outer_state=cpu`)",
        "",
        "In the same processes, after the rounds above, with the gradients and AdamW's moments "
        "dropped (no round reads them): twice in turn, a fresh averager with the anchor and "
        "outer momentum on the device and one with them in host memory (the pseudo-gradient "
        "computed on the host, its mean copied back there for the outer step, the new model "
        f"copied up: four model-sized copies a round; the same bits), one untimed round each, "
        f"then {args.rounds} timed; the median of the {2 * args.rounds} rounds of each, the "
        "slowest rank's. **On this CPU machine the host is the device**: the ratio measures "
        "those extra copies only, and the option saves no memory here. What it costs over "
        "PCIe, and saves on a GPU, is measured by experiments/gpu_check/gpu_check.py.",
        "",
        "| one blocking averaging round (s, median of the slowest rank) | 4 x 1 | 2 x 2 |",
        "|---|---|---|",
        f"| `sync.outer_state=device` | {one['device_round_s']:.3f} | "
        f"{two['device_round_s']:.3f} |",
        f"| `sync.outer_state=cpu` | {one['cpu_round_s']:.3f} | {two['cpu_round_s']:.3f} |",
        f"| ratio cpu / device | {one['cpu_round_s'] / one['device_round_s']:.2f} | "
        f"{two['cpu_round_s'] / two['device_round_s']:.2f} |",
        "",
        "| rank 0's state with `sync.outer_state=cpu` (GiB) | 4 x 1 | 2 x 2 |",
        "|---|---|---|",
        *(
            f"| {name} | {_gib(get(one['rank0']['host_state']))} | "
            f"{_gib(get(two['rank0']['host_state']))} |"
            for name, get in (
                ("the averager's on the device (`averager`)", lambda s: s["averager"]),
                (
                    "in host memory (`host`: anchor, outer momentum, staging)",
                    lambda s: s["host"]["total"],
                ),
            )
        ),  # fmt: skip
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

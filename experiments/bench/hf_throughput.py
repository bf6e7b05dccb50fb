"""model=hf's throughput: the same Llama shape through localsgd's trainer, against a plain torch
loop over the same Hugging Face model, and against our own GPT of the same width and depth.

Three variants in the same 2 gloo worker processes, interleaved round-robin over repetitions
(`rotated`), each run a fresh model from the same seed on the same data=hf windows:

- `hf`: `Trainer.train()` with `model=hf` (transformers' LlamaForCausalLM), DiLoCo every
  `period` steps: the loop `python -m localsgd.train` runs (sampler, streamed windows, LR
  schedule, the model's own loss, logging, the averages);
- `hand`: the loop a user writes around the same Hugging Face model: the same shard, batches and
  AdamW, `model(input_ids=x).logits`, cross-entropy, backward, step; no averaging;
- `transformer`: `Trainer.train()` with `model=transformer` (our GPT: d_model, layers and heads
  as the Llama's, a 4x GELU MLP where the Llama's SwiGLU is 8/3x: about the same parameters).

A run's time is its slowest rank's training loop (no evaluation). The target (issue 50): `hf`
within 10% of `hand`'s or of `transformer`'s steps/s.

    python experiments/bench/hf_throughput.py          # 4 layers of 128, ~3 min on 2 cores
    python experiments/bench/hf_throughput.py --tiny   # toy size: proves the script runs

Writes experiments/bench/HF.md (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.bench.common import (  # noqa: E402
    load_average,
    machine,
    median,
    rotated,
    run_world,
)

VARIANTS = ("hf", "hand", "transformer")
FULL = {"hidden": 128, "layers": 4, "heads": 4, "intermediate": 344, "seq": 128, "batch": 16,
        "steps": 40, "reps": 5, "period": 50, "docs": 4000}  # fmt: skip
TINY = {"hidden": 16, "layers": 1, "heads": 2, "intermediate": 40, "seq": 16, "batch": 4,
        "steps": 4, "reps": 1, "period": 2, "docs": 200}  # fmt: skip


def write_corpus(folder: str, docs: int) -> str:
    """A JSON-lines corpus of made-up sentences (the benchmark times steps, not learning)."""
    import numpy as np

    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis",
             "nobler", "in", "mind", "suffer", "slings", "and", "arrows", "of",
             "fortune"]  # fmt: skip
    rng = np.random.default_rng(0)
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 60))}) + "\n")
    return path


def job_config(variant: str, corpus: str, cache: str, p: dict):
    from hydra import compose, initialize_config_dir

    import localsgd.cli.train  # noqa: F401  (registers the config schema)
    from localsgd.config import typed

    model = (
        ["model=transformer", f"model.d_model={p['hidden']}", f"model.n_layers={p['layers']}",
         f"model.n_heads={p['heads']}"]
        if variant == "transformer"
        else ["model=hf", "model.family=llama", f"model.hidden_size={p['hidden']}",
              f"model.num_hidden_layers={p['layers']}", f"model.num_attention_heads={p['heads']}",
              f"model.intermediate_size={p['intermediate']}"]
    )  # fmt: skip
    overrides = model + [
        "data=hf",
        f"data.path={corpus}",
        f"data.cache_dir={cache}",
        f"data.seq_len={p['seq']}",
        "sync=diloco",
        f"sync.period={p['period']}",
        "optim=adamw",
        "optim.lr=0.003",
        "lr_schedule=constant",
        f"trainer.batch_size={p['batch']}",
        f"trainer.max_steps={p['steps']}",
        f"trainer.eval_every={p['steps'] + 1}",
        "trainer.checkpoint_every=0",
        "trainer.track_drift=false",
        "trainer.progress=false",
        "trainer.sample_chars=0",
        "logger.wandb.mode=disabled",
    ]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return typed(cfg)  # what the workers of a real run get


def hand_loop(cfg, rank: int, world_size: int) -> float:
    """The same Hugging Face model, shard, batches and AdamW in a plain torch loop."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import default_collate

    from localsgd.data import ShardSampler, input_shape_of, labels_of, load_data, shard_indices
    from localsgd.models import build_model

    data = load_data(cfg.data, seed=cfg.seed)
    shard = shard_indices(labels_of(data.train), world_size, rank, "iid", seed=cfg.seed)
    batches = ShardSampler(shard, cfg.trainer.batch_size, seed=cfg.seed, rank=rank)
    torch.manual_seed(cfg.seed)
    lm = build_model(cfg.model, input_shape_of(data), data.num_classes, "lm").lm  # the HF model
    o = cfg.optim
    opt = torch.optim.AdamW(lm.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    dist.barrier()  # start together, as the trainer's initial broadcast does
    start = time.perf_counter()
    for _ in range(cfg.trainer.max_steps):
        x, y = default_collate([data.train[int(i)] for i in batches.next_batch()])
        logits = lm(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    wall = time.perf_counter() - start
    del lm, opt
    gc.collect()
    return wall


def _worker(rank: int, world_size: int, configs: dict, reps: int) -> dict:
    import torch

    from localsgd.loop.trainer import Trainer
    from localsgd.loop.worker import WorkerInfo

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    params = {}
    for rep in range(reps):
        for variant in rotated(VARIANTS, rep):
            if variant == "hand":
                times[variant].append(hand_loop(configs[variant], rank, world_size))
                continue
            with tempfile.TemporaryDirectory() as run_dir:
                info = WorkerInfo(rank, world_size, rank, world_size)
                trainer = Trainer(configs[variant], info, torch.device("cpu"), run_dir)
                params[variant] = trainer.param_count
                trainer.train()
                times[variant].append(trainer.loop_seconds)
                del trainer
                gc.collect()
    return {"times": times, "params": params}


def run(p: dict, timeout_s: float = 900.0) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        corpus, cache = write_corpus(folder, p["docs"]), os.path.join(folder, "cache")
        configs = {v: job_config("hf" if v == "hand" else v, corpus, cache, p) for v in VARIANTS}
        from localsgd.data import load_data

        load_data(configs["hf"].data, seed=0)  # tokenized here once, as the launcher does
        per_rank = run_world(_worker, 2, configs, p["reps"], timeout_s=timeout_s)
    slowest = {v: [max(r["times"][v][i] for r in per_rank) for i in range(p["reps"])]
               for v in VARIANTS}  # fmt: skip
    rate = {v: p["steps"] / median(slowest[v]) for v in VARIANTS}
    return {
        "times": slowest,
        "steps_per_s": rate,
        "hf_vs_hand": rate["hf"] / rate["hand"],
        "hf_vs_transformer": rate["hf"] / rate["transformer"],
        "params": per_rank[0]["params"],
        "p": p,
    }


def render(result: dict, command: str, started, seconds: float, load: str) -> str:
    p, rate, t = result["p"], result["steps_per_s"], result["times"]
    params = result["params"]
    rows = [
        f"| {v} | {rate[v]:.2f} | {rate['hf'] / rate[v]:.3f} | "
        + ", ".join(f"{x:.2f}" for x in t[v])
        + " |"
        for v in VARIANTS
    ]
    return "\n".join(
        [
            "# model=hf throughput: the trainer over a Hugging Face Llama, a plain torch loop "
            "over it, and our GPT",
            "",
            f"- command: `{command}`",
            f"- started: {started.isoformat(timespec='seconds')}; took {seconds:.0f} s",
            f"- machine: {machine()}; load average at start: {load}, at end: {load_average()}",
            f"- shape: {p['layers']} layers of {p['hidden']}, {p['heads']} heads, Llama MLP "
            f"{p['intermediate']} (SwiGLU), seq {p['seq']}, byte-level vocabulary (257); "
            f"parameters: hf {params.get('hf', 0):,}, transformer {params.get('transformer', 0):,}",
            f"- 2 gloo ranks, 1 thread each; batch {p['batch']} a rank, {p['steps']} steps a "
            f"run, {p['reps']} runs a variant, interleaved; DiLoCo every {p['period']} steps in "
            "the trainer's runs, none in the hand loop",
            "",
            "| variant | steps/s (median) | hf / variant | run times (s) |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            f"**hf / hand = {result['hf_vs_hand']:.3f}, hf / transformer = "
            f"{result['hf_vs_transformer']:.3f}** (target: within 10%, 0.9 to 1.1).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="toy size: proves the script runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "experiments/bench/HF.md"))
    args = parser.parse_args(argv)
    p = TINY if args.tiny else FULL
    shown = sys.argv[1:] if argv is None else argv
    command = " ".join(["python experiments/bench/hf_throughput.py", *shown])
    load, t0 = load_average(), time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc)
    result = run(p)
    text = render(result, command, started, time.perf_counter() - t0, load)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({k: v for k, v in result.items()}, f, indent=1)
    print(text, end="")
    return result


if __name__ == "__main__":
    main()

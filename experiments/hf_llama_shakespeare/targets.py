"""Issue 50's targets for `+experiment=hf_llama_shakespeare`, measured: the preset as it ships
(DiLoCo, 2 workers) and sharded (`dist.world_size=4 dist.shard_size=2`: 2 replica groups of 2
ranks, FSDP2 inside each), each through the CLI, then for each run:

- the validation loss of the model it started from (the run's config and seed, evaluated on the
  whole validation split) against the run's final validation loss (`summary.json`): the target
  is a drop of at least 30%;
- `AutoModelForCausalLM.from_pretrained(run_dir/hf)`'s logits against the run's final model
  (`model.pt` in the model the config builds) on 16 validation windows: the target is 1e-6;
- `AutoTokenizer` + `generate` from `hf/` alone: a greedy continuation of a prompt.

    make data && python experiments/hf_llama_shakespeare/targets.py   # ~5 min on 2 cores

Writes results.json and README.md beside this file (or `--out`); the runs go to a temporary
folder (or `--runs`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {
    "diloco_2_workers": [],
    "sharded_4_ranks_2_groups": ["dist.world_size=4", "dist.shard_size=2"],
}
PROMPT = "ROMEO:\n"


def train(run_dir: str, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "localsgd.train", "+experiment=hf_llama_shakespeare",
           "logger.wandb.mode=disabled", "trainer.progress=false", f"hydra.run.dir={run_dir}",
           *extra]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def measure(run_dir: str) -> dict:
    import torch

    from localsgd.cli.export import _config
    from localsgd.data import eval_batches, input_shape_of, load_data, task_of
    from localsgd.loop.evaluation import evaluate
    from localsgd.models import build_model
    from localsgd.models.hf import import_transformers

    transformers = import_transformers()
    config = _config(run_dir, None)
    data = load_data(config["data"], seed=config["seed"])
    torch.manual_seed(config["seed"])  # what every rank starts from
    model = build_model(config["model"], input_shape_of(data), data.num_classes, task_of(data))
    batches = eval_batches(data.test, 256, torch.device("cpu"))
    untrained = evaluate(model, batches, contextlib.nullcontext, "lm")["test_loss"]
    model.load_state_dict(torch.load(os.path.join(run_dir, "model.pt"), weights_only=True))
    model.eval()
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    folder = os.path.join(run_dir, "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.stack([data.test[i][0] for i in range(16)])
    with torch.no_grad():
        gap = float((loaded(input_ids=x).logits - model(x)).abs().max())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = loaded.generate(ids, max_new_tokens=120, do_sample=False)
    return {
        "untrained_loss": untrained,
        "final_loss": summary["test_loss"],
        "drop": 1 - summary["test_loss"] / untrained,
        "hf_logits_max_abs_diff": gap,
        "params": summary["params"],
        "steps": summary["steps"],
        "comm_rounds": summary["comm_rounds"],
        "wall_time_s": summary["wall_time_s"],
        "shard_size": summary["shard_size"],
        "generated": tokenizer.decode(out[0][ids.shape[1] :]),
    }


def render(results: dict, command: str, started: str) -> str:
    rows = [
        f"| {name} | {r['shard_size']} | {r['untrained_loss']:.3f} | {r['final_loss']:.3f} | "
        f"**{100 * r['drop']:.1f}%** | **{r['hf_logits_max_abs_diff']:.1e}** | "
        f"{r['wall_time_s']:.0f} s ({r['run_seconds']:.0f} s in all) |"
        for name, r in results.items()
    ]
    samples = [f"- {name}: `{PROMPT!r}` -> `{r['generated']!r}`" for name, r in results.items()]
    return "\n".join(
        [
            "# +experiment=hf_llama_shakespeare: issue 50's targets",
            "",
            f"- command: `{command}`; started {started}; every figure in results.json",
            "- read in [docs/performance.md](../../docs/performance.md#hugging-face-models-modelhf)"
            " and [docs/configuration.md]"
            "(../../docs/configuration.md#exporting-hf-and-python--m-localsgdexport)",
            "- the preset: transformers' LlamaForCausalLM, 4 layers of 128, 4 heads, SwiGLU 344 "
            "(0.9M parameters), on the Shakespeare corpus in bytes (data=hf, 257 tokens, "
            "windows of 128+1), DiLoCo every 25 steps (the first 2 outer steps warmed up), "
            "inner AdamW lr 3e-3, 200 steps of batch 16 a worker, 2% of the text held out",
            "- loss: nats per byte on the whole validation split; untrained: the run's initial "
            "model (its config and seed); drop = 1 - final / untrained (target >= 30%)",
            "- hf/: `AutoModelForCausalLM.from_pretrained(run_dir/hf)`'s logits against the "
            "run's final model on 16 validation windows (target <= 1e-6)",
            "",
            "| run | dist.shard_size | untrained loss | final loss | drop | hf/ logits max diff "
            "| training loop (run) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "The preset's settings (inner lr, DiLoCo's period, steps, held-out share) were "
            "chosen on the first run; the sharded run, 2 replica groups of 2 ranks with FSDP2 "
            "inside each on the same seed, is a layout they were not tuned on, and met both "
            "targets too. One seed each: the drop is far from the 30% line either way.",
            "",
            "Greedy continuations from `hf/` alone (`AutoTokenizer`, `generate`):",
            "",
            *samples,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE)
    parser.add_argument("--runs", default=None, help="the run directories (default: a new "
                        "temporary folder)")  # fmt: skip
    args = parser.parse_args(argv)
    runs = args.runs or tempfile.mkdtemp(prefix="hf_llama_shakespeare-")
    sys.path.insert(0, ROOT)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    results = {}
    for name, extra in RUNS.items():
        run_dir = os.path.join(runs, name)
        if os.path.exists(run_dir):
            raise SystemExit(f"{run_dir} exists: remove it to measure again")
        seconds = train(run_dir, extra)
        results[name] = {**measure(run_dir), "run_seconds": seconds}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = render(results, "python experiments/hf_llama_shakespeare/targets.py", started)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return results


if __name__ == "__main__":
    main()

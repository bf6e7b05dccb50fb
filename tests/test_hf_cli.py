"""model=hf with data=hf through the CLI: a run writes hf/ that from_pretrained loads with the
run's final logits; the export of checkpoints; sharded runs; a run killed mid-epoch resumes bit
for bit; every strategy, wire, trust and fault-tolerance mode runs with it; the preset at toy
size learns. Only the first test is in `make test`; the others are `long`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import FAST, ROOT, killed_and_resumed, run, run_cli, train_records
from tests.test_hf import TINY, TOKENIZER, documents, write_jsonl

TINY_ARGS = [f"model.{k}={v}" for k, v in TINY.items()]


def hf_args(tmp_path, *extra: str) -> list[str]:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_jsonl(corpus, documents(400))
    base = [a for a in FAST if not a.startswith(("data", "model"))]
    return base + [
        "data=hf", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=16", "model=hf", *TINY_ARGS, "dist.world_size=2", "trainer.batch_size=8",
        "trainer.max_steps=12", "trainer.eval_every=6", "trainer.log_every=3",
        "trainer.sample_chars=20", "optim=adamw", "optim.lr=0.003", *extra,
    ]  # fmt: skip


def run_model(run_dir, trained: bool = True):
    """The run's final model (model.pt) in the model its config builds, or (`trained` False)
    the model it started from; and the run's data."""
    from localsgd.cli.export import _config
    from localsgd.data import input_shape_of, load_data, task_of
    from localsgd.models import build_model

    config = _config(str(run_dir), None)
    data = load_data(config["data"], seed=config["seed"])
    torch.manual_seed(config["seed"])  # as the trainer does: every rank's initial model
    model = build_model(config["model"], input_shape_of(data), data.num_classes, task_of(data))
    if trained:
        model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    return model.eval(), data


def hf_gap(run_dir, folder: str = "hf") -> float:
    """The largest difference between from_pretrained(run_dir/folder)'s logits and the run's
    final model's, on the run's held-out windows."""
    from localsgd.models.hf import import_transformers

    transformers = import_transformers()
    model, data = run_model(run_dir)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / folder).eval()
    x = torch.stack([data.test[i][0] for i in range(min(8, len(data.test)))])
    with torch.no_grad():
        return float((loaded(input_ids=x).logits - model(x)).abs().max())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_diloco_run_writes_hf_that_from_pretrained_loads_with_its_logits(tmp_path):
    from localsgd.cli.export import main as export

    run_dir = tmp_path / "run"
    args = hf_args(tmp_path, f"data.tokenizer={TOKENIZER}", "sync=diloco", "sync.period=4")
    proc = run_cli(args + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tokenized once") == 1  # by the launcher, not by each worker
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["dataset"], summary["model"]) == ("hf_text", "causal_lm")
    assert isinstance(summary["sample"], str) and summary["test_loss"] < 6.2  # ln 512 = 6.24
    assert hf_gap(run_dir) <= 1e-6
    from localsgd.models.hf import import_transformers

    tokenizer = import_transformers().AutoTokenizer.from_pretrained(run_dir / "hf")
    assert tokenizer.vocab_size == 512 and tokenizer.eos_token == "<|endoftext|>"
    # the export of the run, and of its final checkpoint, in this process
    assert export([str(run_dir), "--out", str(tmp_path / "again")]) == 0
    assert hf_gap(run_dir, str(tmp_path / "again")) <= 1e-6
    assert export([str(run_dir / "checkpoints" / "step-12")]) == 0
    assert (run_dir / "hf-step-12" / "model.safetensors").is_file()
    (run_dir / "model.pt").rename(tmp_path / "model.pt")  # a run that did not finish
    assert export([str(run_dir), "--out", str(tmp_path / "newest")]) == 0
    assert (tmp_path / "newest" / "tokenizer.json").is_file()
    (tmp_path / "model.pt").rename(run_dir / "model.pt")
    shutil.rmtree(run_dir / "checkpoints")  # the config from .hydra/config.yaml then
    assert export([str(run_dir), "--out", str(tmp_path / "no_checkpoint")]) == 0
    assert hf_gap(run_dir, str(tmp_path / "no_checkpoint")) <= 1e-6
    assert export([str(tmp_path)]) == 2  # not a run: one line, exit code 2


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_sharded_run_writes_hf_from_the_gathered_state_and_exports_its_dcp_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = hf_args(tmp_path, "dist.world_size=4", "dist.shard_size=2", "sync.period=4")
    proc = run_cli(args + [f"hydra.run.dir={run_dir}"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hf_gap(run_dir) <= 1e-6
    # the final checkpoint (DCP, between syncs): its groups' mean is the final average's model
    from localsgd.cli.export import main as export

    assert export([str(run_dir / "checkpoints" / "step-12")]) == 0
    assert hf_gap(run_dir, "hf-step-12") <= 1e-6


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
def test_a_run_killed_mid_epoch_resumes_bit_for_bit(tmp_path):
    args = hf_args(tmp_path, "sync=diloco", "sync.period=5", "trainer.max_steps=24")
    args += ["trainer.checkpoint_every=5", "+model.config.attention_dropout=0.1"]
    reference, resumed = killed_and_resumed(args, tmp_path)  # killed after step 13 of 94/epoch
    assert train_records(resumed) == train_records(reference)
    a, b = ((d / "hf" / "model.safetensors").read_bytes() for d in (reference, resumed))
    assert a == b


MODES = [
    "sync=streaming_diloco sync.period=6 sync.fragments=2",
    "+experiment=sparseloco_nesterov sync.period=4 sync.topk_chunk=256",
    "sync=diloco sync.period=4 sync.comm_dtype=int4 sync.error_feedback=true",
    "sync=diloco sync.period=4 sync.aggregate=median sync.score=true sync.score_batch=8 "
    "dist.world_size=3",
    "sync=diloco sync.period=4 ft=torchft",
    "sync=diloco sync.period=4 dist.virtual_workers=2",
    "sync=post_local_sgd sync.warmup_steps=4 sync.period=4 trainer.precision=bf16-mixed "
    "trainer.activation_checkpointing=true trainer.accumulate_grad_batches=2",
    "sync=local_sgd sync.period=4 trainer.compile=true model.family=gpt2",
    "sync=diloco sync.period=4 model.family=gpt2 dist.world_size=4 dist.shard_size=2",  # tied
    "sync=slowmo sync.period=4",
    "sync=hierarchical sync.levels=[{group_size:2,period:2},{group_size:world,period:4}] "
    "dist.world_size=4",
    "sync=adaptive sync.period=2",
    "sync=local_sgd sync.period=4 sync.overlap=true",
    "sync=diloco sync.period=4 sync.eager=true",
    "sync=diloco sync.period=4 optim=muon sync.optimizer_state=desloc",
    "sync=diloco sync.period=4 sync.inner_time_s=0.5 comm.simulate.worker_speed=[1,2] "
    "comm.simulate.step_s=0.02",
]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_model_hf_and_writes_hf(mode, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(hf_args(tmp_path, *mode.split()) + [f"hydra.run.dir={run_dir}"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hf_gap(run_dir) <= 1e-6


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
def test_character_data_trains_model_hf_and_token_data_trains_model_transformer(tmp_path):
    from localsgd.models.hf import import_transformers

    text = tmp_path / "input.txt"
    text.write_text("".join(documents(300)), encoding="utf-8")
    base = [a for a in hf_args(tmp_path) if not a.startswith("data")]
    chars = tmp_path / "chars"
    proc = run_cli(base + ["data=text", f"data.path={text}", "data.seq_len=16",
                           f"hydra.run.dir={chars}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hf_gap(chars) <= 1e-6
    tokenizer = import_transformers().AutoTokenizer.from_pretrained(chars / "hf")
    vocab = "".join(sorted(set(text.read_text())))
    assert tokenizer("to be")["input_ids"] == [vocab.index(c) for c in "to be"]
    gpt = tmp_path / "gpt"
    args = [a for a in hf_args(tmp_path) if not a.startswith("model")] + [
        "model=transformer", "model.d_model=32", "model.n_layers=1", f"hydra.run.dir={gpt}"
    ]  # fmt: skip
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((gpt / "summary.json").read_text())
    assert summary["model"] == "transformer" and not (gpt / "hf").exists()


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(120)
def test_runs_without_hugging_face_never_import_it(tmp_path):
    """What a run of another model and data imports, in the launcher and in a worker: neither
    transformers nor datasets (their import costs seconds)."""
    code = "\n".join(
        [
            "import sys",
            "from hydra import compose, initialize_config_dir",
            "import localsgd.loop.trainer  # what a worker imports",
            "from localsgd.cli.train import preflight",
            f"with initialize_config_dir(config_dir={os.path.join(ROOT, 'conf')!r}, "
            "version_base='1.3'):",
            "    cfg = compose('config', overrides=['dist.world_size=2', 'model=transformer',",
            "        'data=text', f'data.path={sys.argv[1]}', 'data.seq_len=8'])",
            "preflight(cfg, None)  # what the launcher checks: builds the data and the model",
            "print('imported', [m for m in ('transformers', 'datasets', 'tokenizers')",
            "    if m in sys.modules])",
        ]
    )
    text = tmp_path / "input.txt"
    text.write_text("".join(documents(50)), encoding="utf-8")
    proc, _ = run([sys.executable, "-c", code, str(text)], timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "imported []" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_preset_at_toy_size_beats_the_untrained_model_by_30_percent(tmp_path):
    from localsgd.data import eval_batches
    from localsgd.loop.evaluation import evaluate

    corpus = tmp_path / "input.txt"
    corpus.write_text("".join(documents(600)), encoding="utf-8")
    run_dir = tmp_path / "run"
    args = ["+experiment=hf_llama_shakespeare", f"data.path={corpus}", "data.test_fraction=0.1",
            f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "trainer.max_steps=60",
            "trainer.eval_every=30", "trainer.progress=false", "logger.wandb.mode=disabled",
            "logger.plots=false", "model.hidden_size=64", "model.num_hidden_layers=2",
            "sync.period=10", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = run_cli(args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    untrained, data = run_model(run_dir, trained=False)
    batches = eval_batches(data.test, 256, torch.device("cpu"))
    before = evaluate(untrained, batches, contextlib.nullcontext, "lm")["test_loss"]
    assert summary["test_loss"] <= 0.7 * before, (summary["test_loss"], before)
    assert untrained.lm.config.model_type == "llama" and hf_gap(run_dir) <= 1e-6


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(120)
def test_processes_preparing_the_same_corpus_at_once_tokenize_it_once(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", documents(3000))
    code = (
        "import sys; from localsgd.data.hf import hf_text; "
        f"hf_text({corpus!r}, seq_len=16, cache_dir={str(tmp_path / 'cache')!r})"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=-1, stderr=-1, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=100) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    assert sum(o[0].count("tokenized once") for o in outs) == 1
    assert len([n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")]) == 1


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(180)
def test_tokenizing_streams_a_corpus_in_bounded_memory(tmp_path):
    """Tokenizing takes the memory of a batch of records, not of the corpus: a JSON-lines
    corpus 8x as large (256 MiB against 32 MiB) grows a fresh process's peak RSS by about as
    much (datasets' and pyarrow's reading buffers: ~150 MiB here, whatever the size), by far
    less than the corpus."""
    line = json.dumps({"text": "x" * 4000}) + "\n"
    code = (
        "import resource, sys, datasets, tokenizers, numpy; "
        "from localsgd.data.hf import hf_text; "
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "hf_text(sys.argv[1], seq_len=64, cache_dir=sys.argv[2]); "
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "print('growth_kib', after - before)"
    )
    growth = {}
    for mib in (32, 256):
        corpus = tmp_path / f"{mib}.jsonl"
        with open(corpus, "w") as f:
            f.write(line * (mib * 2**20 // len(line)))
        proc, _ = run([sys.executable, "-c", code, str(corpus), str(tmp_path / "cache")],
                      timeout=80)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        growth[mib] = int(proc.stdout.split("growth_kib")[1].split()[0]) / 1024
        corpus.unlink()
    assert growth[256] < growth[32] + 64 and growth[256] < 256, growth  # MiB


@pytest.mark.slow
@pytest.mark.long  # a benchmark at toy size: `make test-long`
@pytest.mark.timeout(180)
def test_hf_throughput_benchmark_runs_at_tiny_size(tmp_path):
    """experiments/bench/hf_throughput.py: the trainer over a Hugging Face Llama, a plain loop
    over it and our GPT, side by side in the same 2 processes; every variant has a rate."""
    out = tmp_path / "HF.md"
    proc, _ = run(
        [sys.executable, "experiments/bench/hf_throughput.py", "--tiny", "--out", str(out)],
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["steps_per_s"]) == {"hf", "hand", "transformer"}
    assert all(rate > 0 for rate in result["steps_per_s"].values())
    assert result["hf_vs_hand"] == pytest.approx(
        result["steps_per_s"]["hf"] / result["steps_per_s"]["hand"]
    )
    assert "| hf |" in out.read_text() and "hf / hand" in out.read_text()

"""model=hf and data=hf in-process: the Hugging Face model builder and its loss, the corpus
read through `datasets` and tokenized once, its windows, shards and resumable stream, hf/ as
from_pretrained loads it, and the one-line refusals (tests/test_hf_cli.py runs the CLI)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from localsgd.config import ConfigError
from localsgd.data import ShardSampler, labels_of, make_batches, shard_indices
from localsgd.data.hf import TokenWindows, hf_text
from localsgd.data.token_cache import _byte_ids
from localsgd.data.tokens import byte_tokenizer, char_tokenizer
from localsgd.loop.evaluation import held_out_loss, loss_and_correct
from localsgd.models.hf import causal_lm, import_transformers
from localsgd.models.hf_export import write_hf
from tests.helpers import ROOT, refusal

TOKENIZER = os.path.join(ROOT, "examples", "tokenizer.json")
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def documents(n: int = 60) -> list[str]:
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis",
             "nobler", "in", "mind", "suffer"]  # fmt: skip
    rng = np.random.default_rng(0)
    ends = ["\n" if i % 5 == 0 else "" for i in range(n)]
    return [" ".join(rng.choice(words, 12 + i % 7)) + ends[i] for i in range(n)]


def write_jsonl(path, docs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return str(path)


def write_parquet(path, docs) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=7)
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    docs = documents()
    return docs, write_jsonl(tmp_path / "c.jsonl", docs), tmp_path / "cache"


def windows(split) -> torch.Tensor:
    return torch.stack([torch.cat([x, y[-1:]]) for x, y in (split[i] for i in range(len(split)))])


@pytest.mark.timeout(60)
def test_byte_tokens_are_the_utf8_bytes_and_decode_back():
    text = "Héllo, wörld!\n  ça va? 日本 <b>"
    tok = byte_tokenizer()
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8")) == _byte_ids([text])[0].tolist()
    assert tok.decode(ids) == text and tok.get_vocab_size() == 257
    chars = char_tokenizer("\n abc")
    assert chars.encode("cab a\nb").ids == [4, 2, 3, 1, 2, 0, 3]
    assert chars.decode(chars.encode("cab a\nb").ids) == "cab a\nb"


@pytest.mark.timeout(60)
def test_jsonl_parquet_and_a_saved_dataset_of_the_same_text_give_the_same_windows(corpus, tmp_path):
    import datasets

    docs, jsonl, cache = corpus
    parquet = write_parquet(tmp_path / "c.parquet", docs)
    saved, split = tmp_path / "saved", tmp_path / "split"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(saved))
    other = datasets.Dataset.from_dict({"text": ["another split"] * 3})
    datasets.DatasetDict({"held": other, "main": datasets.load_from_disk(saved)}).save_to_disk(
        str(split)
    )
    renamed = tmp_path / "c.data"  # no known extension: data.format says what it is
    renamed.write_text(Path(jsonl).read_text())
    splits = [hf_text(p, seq_len=16, cache_dir=cache) for p in (jsonl, parquet, str(saved))]
    splits.append(hf_text(str(split), seq_len=16, split="main", cache_dir=cache))
    splits.append(hf_text(str(renamed), seq_len=16, format="json", cache_dir=cache))
    for other in splits[1:]:
        assert torch.equal(windows(other.train), windows(splits[0].train))
        assert torch.equal(windows(other.test), windows(splits[0].test))
    # the token stream: each document's bytes, then <|endoftext|>; packed across documents
    stream = [b for d in docs for b in [*d.encode("utf-8"), 256]]
    n, n_test = len(stream) // 17, len(splits[0].test)
    packed = torch.tensor(stream[: 17 * (n - n_test)])
    assert torch.equal(windows(splits[0].train).flatten(), packed)
    assert n_test == round(n * 0.1) and splits[0].num_classes == 257
    # a tokenizer.json: its ids, the same from either format
    a, b = (hf_text(p, seq_len=16, cache_dir=cache, tokenizer=TOKENIZER) for p in (jsonl, parquet))
    assert torch.equal(windows(a.train), windows(b.train)) and a.num_classes == 512
    assert len(a.train) < len(splits[0].train)  # merges: fewer tokens than bytes


@pytest.mark.timeout(60)
def test_text_files_keep_every_character_and_end_each_file_with_eos(tmp_path):
    folder = tmp_path / "texts"
    (folder / "b").mkdir(parents=True)
    parts = ["First file,\n\nwith lines.\n" * 20, "second\r\nfile, no newline at its end" * 10]
    for name, text in zip(("a.txt", "b/c.txt"), parts, strict=True):  # in name order, any depth
        (folder / name).write_bytes(text.encode("utf-8"))
    (folder / "README").write_text("not part of the corpus")  # no known extension: left out
    for eos, end in ((None, [256]), ("", [])):  # data.eos_token "": nothing between documents
        data = hf_text(str(folder), seq_len=8, test_fraction=0.2, eos_token=eos,
                       cache_dir=tmp_path / "cache")  # fmt: skip
        stream = [b for t in parts for b in [*t.encode("utf-8"), *end]]
        got = torch.cat([windows(data.train), windows(data.test)]).flatten().tolist()
        assert got == stream[: len(got)] and len(stream) - len(got) < 9


@pytest.mark.timeout(60)
def test_the_corpus_is_tokenized_once_and_read_from_disk(corpus, monkeypatch, capsys):
    from localsgd.data import token_cache

    _, jsonl, cache = corpus
    first = hf_text(jsonl, seq_len=16, cache_dir=cache)
    assert "tokenized once" in capsys.readouterr().out
    monkeypatch.setattr(token_cache, "batches", lambda *a: pytest.fail("tokenized again"))
    again = hf_text(jsonl, seq_len=32, cache_dir=cache)  # other windows of the same tokens
    assert capsys.readouterr().out == "" and len(again.train) < len(first.train)
    # the windows are views of the mapped token file, not tensors in memory
    assert isinstance(first.train, TokenWindows) and len(os.listdir(cache)) == 2  # entry, lock
    mapped = first.train.tokens.ids(writable=True)
    assert np.shares_memory(labels_of(first.train).numpy(), mapped)
    # a changed file is a new entry
    with open(jsonl, "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    monkeypatch.undo()
    hf_text(jsonl, seq_len=16, cache_dir=cache)
    assert "tokenized once" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_shards_are_disjoint_cover_the_train_windows_and_resume_mid_epoch(corpus):
    _, jsonl, cache = corpus
    data = hf_text(jsonl, seq_len=16, cache_dir=cache)
    labels = labels_of(data.train)
    for partition in ("iid", "contiguous"):
        shards = [shard_indices(labels, 3, r, partition, seed=0) for r in range(3)]
        joined = torch.cat(shards).sort().values
        assert torch.equal(joined, torch.arange(len(data.train)))  # disjoint, all of them
    # the held-out windows lie after every train window in the token stream
    assert data.test.first == len(data.train)
    cfg = {"loader": "auto", "num_workers": 0}
    make = lambda: make_batches(  # noqa: E731
        data, cfg, ShardSampler(shards[1], 4, seed=0, rank=1), torch.device("cpu")
    )
    straight = make()
    assert type(straight).__name__ == "StreamBatches"  # windows read on demand
    batches = [straight.next() for _ in range(7)]
    stopped = make()
    [stopped.next() for _ in range(3)]
    state = stopped.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for x, y in batches[3:]:
        rx, ry = resumed.next()
        assert torch.equal(rx, x) and torch.equal(ry, y)


@pytest.mark.timeout(90)
def test_the_loss_is_the_models_own_shifted_cross_entropy():
    torch.manual_seed(0)
    model = causal_lm(257, (16,), **TINY)
    window = torch.randint(0, 257, (3, 17))
    x, y = window[:, :-1], window[:, 1:]
    logits = model(x)
    loss, _ = loss_and_correct(logits, y, model)
    # what Hugging Face computes given the whole window as input and labels (it shifts them)
    reference = model.lm(input_ids=window, labels=window).loss
    assert torch.allclose(loss, reference, atol=1e-6)
    assert torch.allclose(
        loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    )
    calls = []
    model.lm_loss = lambda logits, targets: calls.append(1) or torch.zeros(())
    loss_and_correct(logits, y, model)
    assert calls == [1]  # the trainer's loss goes through the model's own
    test = torch.utils.data.TensorDataset(x, y)
    del model.lm_loss
    per_sample = held_out_loss(model, test, 0, 0, 5, torch.device("cpu"), contextlib.nullcontext)
    assert per_sample.shape == (5,) and torch.isfinite(per_sample).all()


@pytest.mark.timeout(90)
def test_families_sizes_config_folders_and_weights(tmp_path):
    from localsgd.averaging.streaming.fragments import model_blocks

    gpt2 = causal_lm(300, (24,), family="gpt2", **TINY)
    assert (gpt2.lm.config.n_embd, gpt2.lm.config.n_layer, gpt2.lm.config.n_positions) == (
        32,
        2,
        24,
    )
    assert gpt2.lm.config.vocab_size == 300 and gpt2.lm.config.eos_token_id is None  # not 50256
    assert model_blocks(gpt2) == list(gpt2.lm.transformer.h)
    with pytest.raises(ConfigError, match=r"^model.num_key_value_heads is no setting of gpt2"):
        causal_lm(300, (24,), family="gpt2", num_key_value_heads=2, **TINY)
    llama = causal_lm(300, (24,), intermediate_size=40, config={"rope_theta": 500.0}, **TINY)
    assert model_blocks(llama) == list(llama.lm.model.layers)
    assert model_blocks(llama, "lm.model.layers") == list(llama.lm.model.layers)
    assert llama.lm.config.num_key_value_heads == 4 and llama.lm.config.intermediate_size == 40
    # a config.json folder, its sizes overridden by the keys given
    llama.lm.config.save_pretrained(tmp_path / "cfg")
    from_folder = causal_lm(300, (24,), config_path=str(tmp_path / "cfg"), num_hidden_layers=1)
    assert from_folder.lm.config.hidden_size == 32 and len(from_folder.lm.model.layers) == 1
    # weights: from_pretrained, the same parameters
    llama.lm.save_pretrained(tmp_path / "weights")
    loaded = causal_lm(300, (24,), weights=str(tmp_path / "weights"))
    assert all(m.training for m in loaded.modules())  # from_pretrained's is in eval mode
    for (name, a), b in zip(llama.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match=r"^model.hidden_size must be null or 32 with model.w"):
        causal_lm(300, (24,), weights=str(tmp_path / "weights"), hidden_size=64)
    with pytest.raises(ConfigError, match=r"^model.family must be a model type"):
        causal_lm(300, (24,), family="no_such_family")


@pytest.mark.timeout(60)
def test_activation_checkpointing_wraps_the_decoder_layers_and_keeps_the_gradients():
    from localsgd.loop.recipe import checkpoint_activations

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = causal_lm(257, (16,), **TINY, config={"attention_dropout": 0.2})
        if checkpointed:
            checkpoint_activations(model)
            assert all(
                isinstance(layer.forward, functools.partial) for layer in model.lm.model.layers
            )
        torch.manual_seed(1)
        x = torch.randint(0, 257, (2, 17))
        model.lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.timeout(90)
def test_hf_folder_loads_with_from_pretrained_and_generates(corpus, tmp_path):
    transformers = import_transformers()
    _, jsonl, cache = corpus
    data = hf_text(jsonl, seq_len=16, cache_dir=cache, tokenizer=TOKENIZER)
    torch.manual_seed(1)
    model = causal_lm(data.num_classes, (16,), **TINY)
    folder = write_hf(model, data, str(tmp_path / "hf"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    x = windows(data.test)[:, :-1]
    assert (loaded(input_ids=x).logits - model.eval()(x)).abs().max() <= 1e-6
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "to be or not"
    assert tokenizer(text)["input_ids"] == data.tokenizer.encode(text).ids
    assert tokenizer.eos_token == "<|endoftext|>" and loaded.config.eos_token_id == data.eos_id
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = loaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5) and isinstance(tokenizer.decode(out[0]), str)
    # a character-level model (data=text): a tokenizer of its characters
    chars = type("Chars", (), {"vocab": "\n abc", "tokenizer": None})()
    small = causal_lm(5, (8,), **TINY)
    write_hf(small, chars, str(tmp_path / "chars"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "chars")
    assert tokenizer("cab a")["input_ids"] == [4, 2, 3, 1, 2]


REFUSALS = [
    ("data.path=MISSING", "data.path must name a local file or folder"),
    ("data.text_field=content", "data.text_field must name a field of the records, got 'content'"),
    ("data.tokenizer=TOKENIZER model.vocab_size=300", "model.vocab_size gives a vocabulary of 300"),
    ("model.max_position_embeddings=8", "data.seq_len must be <= the model's 8 positions"),
    ("model.weights=CORPUS", "model.weights must be a local directory"),
    ("model.weights=MISSING", "model.weights must be a local directory"),
    ("model.config_path=TMP", "model.config_path must hold a config.json"),
    ("data.tokenizer=MISSING", "data.tokenizer must be a local tokenizer.json"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("override,line", REFUSALS)
def test_bad_input_is_refused_in_one_line_before_anything_is_built(override, line, corpus, capsys):
    _, jsonl, cache = corpus
    override = override.replace("MISSING", os.path.join(os.path.dirname(jsonl), "nope"))
    override = override.replace("TOKENIZER", TOKENIZER).replace("CORPUS", jsonl)
    override = override.replace("TMP", os.path.dirname(jsonl))
    args = ["data=hf", f"data.path={jsonl}", f"data.cache_dir={cache}", "data.seq_len=16"]
    args += ["model=hf", "logger.wandb.mode=disabled", f"hydra.run.dir={cache.parent / 'run'}"]
    got = refusal(
        [a for a in args if a.split("=")[0] != override.split("=")[0]] + override.split(), capsys
    )
    assert got.startswith(f"error: {line}"), got
    assert not cache.exists()  # refused before any tokenizing


@pytest.mark.timeout(60)
def test_export_refuses_a_run_of_another_model_in_one_line(tmp_path, capsys):
    from localsgd.cli.export import main as export

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        "seed: 0\nmodel: {_target_: localsgd.models.transformer}\ndata: {_target_: x}\n"
    )
    (run_dir / "model.pt").write_bytes(b"")
    assert export([str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: PATH must be a run of model=hf"), err
    assert not (run_dir / "hf").exists()


@pytest.mark.timeout(60)
def test_the_preset_without_the_corpus_names_the_command_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALSGD_DATA_DIR", str(tmp_path / "empty"))
    line = refusal(["+experiment=hf_llama_shakespeare", f"hydra.run.dir={tmp_path}/run"], capsys)
    assert line.startswith("error: data.path must name") and "make data" in line
    assert str(tmp_path / "empty" / "shakespeare" / "input.txt") in line

"""`data=hf`: a corpus of local files read with Hugging Face `datasets`, tokenized once into a
token file on disk, and cut into windows read from that file on demand.

- **Sources** (`data.path`): text files (each file one document, its lines kept whole), JSON
  lines or Parquet files (each record one document, its text under `data.text_field`), a folder
  of one kind of them, or a folder `Dataset.save_to_disk` wrote (`data.split` of a DatasetDict).
  `datasets.load_dataset(..., streaming=True)` / `load_from_disk` read the records batch by
  batch, text files are read line by line as they are (`datasets`' text reader would rewrite
  their line endings), so no corpus is ever held in memory whole.
- **Tokens** (`localsgd.data.token_cache`): each document tokenized (`data.tokenizer`, a local
  tokenizer.json, or bytes), followed by the end-of-text token, appended to one file of token
  ids under `data.cache_dir`, written once: by the launcher before any worker starts (its
  preflight builds the data), under a file lock that torchrun's ranks wait on, keyed by the
  files' names, sizes and modification times, the field and the tokenizer.
- **Windows**: the token stream in windows of `data.seq_len` + 1 tokens, packed across
  documents as `data=text` packs characters: inputs the first `seq_len`, targets the last. The
  last `data.test_fraction` of the windows is the held-out (validation) split; each worker's
  shard of the rest comes from `data.partition` (iid or contiguous), disjoint by construction.
  A window is read from the memory-mapped token file when a batch needs it; batches are drawn
  by the resumable sampler, so a run stopped mid-epoch resumes bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from localsgd.config import ConfigError
from localsgd.data.datasets import DataSplits, _fraction
from localsgd.data.token_cache import TokenFile, token_file
from localsgd.data.tokens import eos_id, load_tokenizer, vocab_size

# data.format: by file extension (auto), or one kind for every file
EXTENSIONS = {
    "text": (".txt", ".text", ".md"),
    "json": (".jsonl", ".json", ".ndjson"),
    "parquet": (".parquet",),
}
FORMATS = ("auto", "text", "json", "parquet", "disk")
_DISK_MARKERS = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes


@dataclass
class Source:
    """The files of a corpus, of one kind (`disk`: one save_to_disk folder)."""

    kind: str
    files: list[Path]
    split: str = "train"

    def identity(self) -> list:
        """What the token cache is keyed by: every file's path, size and modification time."""
        paths = self.files
        if self.kind == "disk":
            paths = sorted(p for p in self.files[0].rglob("*") if p.is_file())
        return [self.kind, self.split] + [
            [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths
        ]


def find_source(path: str, fmt: str = "auto", split: str = "train") -> Source:
    """The corpus `data.path` names; ConfigError (one line) when it holds none."""
    if fmt not in FORMATS:
        raise ConfigError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    base = Path(os.path.expanduser(str(path)))
    if not path or not base.exists():
        hint = ""
        if str(base).endswith("shakespeare/input.txt"):
            hint = "; run `make data` (python -m localsgd.data.prepare shakespeare) first"
        raise ConfigError(
            f"data.path must name a local file or folder of text, JSON lines or Parquet files, "
            f"or a save_to_disk folder, got {str(path)!r} (no such file or directory){hint}"
        )
    if base.is_dir() and any((base / m).is_file() for m in _DISK_MARKERS):
        if fmt not in ("auto", "disk"):
            raise ConfigError(f"data.format must be auto or disk for {base}, got {fmt!r}")
        return Source("disk", [base], split)
    files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
    kinds = {p: _kind(p, fmt) for p in files}
    if base.is_dir():  # a folder: its files of a known kind; others (a README) are not corpus
        files = [p for p in files if kinds[p] is not None]
    found = sorted({kinds[p] or "unknown" for p in files})
    if len(found) != 1 or found == ["unknown"]:
        allowed = ", ".join(e for exts in EXTENSIONS.values() for e in exts)
        got = "no such files" if not files else f"{', '.join(found)} files"
        raise ConfigError(
            f"data.path must hold files of one kind ({allowed}; or set data.format), got "
            f"{str(path)!r} ({got})"
        )
    return Source(found[0], files, split)


def _kind(file: Path, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    return next((k for k, exts in EXTENSIONS.items() if file.suffix.lower() in exts), None)


def fields_of(source: Source) -> list[str] | None:
    """The record fields of the corpus, read cheaply (a Parquet schema, the first JSON line, a
    save_to_disk folder's info); None for text files, whose field is the line."""
    first = source.files[0]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    if source.kind == "json":
        with open(first, encoding="utf-8") as f:
            line = next((ln for ln in f if ln.strip()), "{}")
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"data.path: {first} is not JSON lines (its first line)") from None
        return list(record) if isinstance(record, dict) else []
    if source.kind == "disk":
        return _disk_fields(first, source.split)
    return None


def _disk_fields(folder: Path, split: str) -> list[str]:
    info = folder / "dataset_info.json"
    if not info.is_file():  # a DatasetDict: its splits in folders of their own
        with open(folder / "dataset_dict.json", encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise ConfigError(
                f"data.split must be one of the saved splits ({', '.join(splits)}), got {split!r}"
            )
        info = folder / split / "dataset_info.json"
    with open(info, encoding="utf-8") as f:
        return list((json.load(f).get("features") or {}).keys())


def check_text_field(source: Source, field: str) -> None:
    fields = fields_of(source)
    if fields is not None and field not in fields:
        raise ConfigError(
            f"data.text_field must name a field of the records, got {field!r} "
            f"({source.files[0]} has: {', '.join(fields) or 'no fields'})"
        )


class TokenWindows(Dataset):
    """Windows `first` .. `first + count - 1` of `seq_len` + 1 tokens of a token file, each read
    when asked for: (inputs, targets) = (window[:-1], window[1:]), int64."""

    def __init__(self, tokens: TokenFile, first: int, count: int, seq_len: int):
        self.tokens, self.first, self.count, self.seq_len = tokens, first, count, seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        start = (self.first + index) * (self.seq_len + 1)
        window = self.tokens.ids()[start : start + self.seq_len + 1].astype(np.int64)
        window = torch.from_numpy(window)
        return window[:-1], window[1:]

    @property
    def targets(self) -> torch.Tensor:
        """Every window's targets (count, seq_len) as a view of the mapped file: nothing is
        read until used (the partition takes only its shape)."""
        ids, step = self.tokens.ids(writable=True), self.seq_len + 1
        start = self.first * step + 1
        view = np.lib.stride_tricks.as_strided(
            ids[start:],
            shape=(self.count, self.seq_len),
            strides=(step * ids.itemsize, ids.itemsize),
        )
        return torch.from_numpy(view)


@dataclass
class TokenSplits(DataSplits):
    """DataSplits of token windows, with the tokenizer (what `hf/` saves and samples decode)."""

    tokenizer: Any = None
    eos_id: int | None = None


def hf_text(
    path: str = "",
    text_field: str = "text",
    tokenizer: str | None = None,
    seq_len: int = 128,
    test_fraction: float = 0.1,
    format: str = "auto",  # noqa: A002  (the key's name: data.format)
    split: str = "train",
    eos_token: str | None = None,
    cache_dir: str | None = None,
) -> TokenSplits:
    """The corpus at `path` as windows of `seq_len` + 1 tokens (module docstring)."""
    if int(seq_len) < 1:
        raise ConfigError(f"data.seq_len must be an integer >= 1, got {seq_len}")
    seq_len = int(seq_len)
    _fraction(test_fraction)
    source = find_source(path, format, split)
    check_text_field(source, text_field)
    tok, identity = load_tokenizer(tokenizer)
    eos = eos_id(tok, eos_token)
    tokens = token_file(source, text_field, tok, identity, eos, cache_dir)
    n_windows = tokens.num_tokens // (seq_len + 1)
    if n_windows < 2:
        raise ConfigError(
            f"data.path must hold at least two windows of data.seq_len+1={seq_len + 1} tokens, "
            f"got {tokens.num_tokens} tokens in {path}"
        )
    n_test = max(1, min(n_windows - 1, int(round(n_windows * float(test_fraction)))))
    n_train = n_windows - n_test
    return TokenSplits(
        train=TokenWindows(tokens, 0, n_train, seq_len),
        test=TokenWindows(tokens, n_train, n_test, seq_len),
        num_classes=vocab_size(tok),
        input_shape=(seq_len,),
        task="lm",
        tokenizer=tok,
        eos_id=eos,
    )

"""The token cache of `data=hf`: a corpus tokenized once into a flat file of token ids.

A cache entry is a folder `CACHE/NAME-KEY/` holding `tokens.bin` (the ids, uint16 when the
vocabulary fits, else uint32, documents one after another, each followed by the end-of-text
id) and `meta.json`. KEY hashes what the ids depend on: the files (path, size, modification
time), the text field, the split, the tokenizer (its file's hash), the end-of-text id and the
`tokenizers` version. The folder is written under a temporary name and renamed into place, and
the writer holds a lock (`fcntl.flock` on `NAME-KEY.lock`): processes that need the same entry
at once (torchrun's ranks, each running the checks) wait for the first and then read its file.
Records stream through in batches of `BATCH` documents: memory stays that of one batch, whatever
the corpus's size.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localsgd.config import ConfigError
from localsgd.data.tokens import BYTE_LEVEL, vocab_size

CACHE_VERSION = 1
BATCH = 1000  # documents tokenized at a time
_FOLDER = "hf_tokens"  # under localsgd.data.prepare.data_dir() unless data.cache_dir


@dataclass
class TokenFile:
    """A cache entry: its token file, dtype and length; `ids()` maps it (read-only by default;
    `writable`: copy-on-write, for views torch takes without a warning)."""

    path: Path
    dtype: str
    num_tokens: int

    def ids(self, writable: bool = False) -> np.ndarray:
        mode = "c" if writable else "r"
        cache = "_mapped_c" if writable else "_mapped"
        if getattr(self, cache, None) is None:
            setattr(self, cache, np.memmap(self.path, dtype=self.dtype, mode=mode))
        return getattr(self, cache)

    def __getstate__(self) -> dict:  # a loader worker started by spawn maps the file again
        return {"path": self.path, "dtype": self.dtype, "num_tokens": self.num_tokens}


def cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(os.path.expanduser(str(cache_dir)))
    from localsgd.data.prepare import data_dir

    return data_dir() / _FOLDER


def token_file(source, field: str, tokenizer, identity: str, eos: int | None, cache_dir):
    """The entry for this corpus and tokenizer, tokenizing it first if no process has."""
    import tokenizers

    key_of = {
        "version": CACHE_VERSION,
        "source": source.identity(),
        "field": field if source.kind != "text" else None,
        "tokenizer": identity,
        "eos": eos,
        "tokenizers": tokenizers.__version__,
    }
    key = hashlib.sha256(json.dumps(key_of, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(cache_dir)
    folder = root / f"{source.files[0].stem[:40]}-{key}"
    entry = _read(folder)
    if entry is not None:
        return entry
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"data.cache_dir must be a writable folder, got {str(root)!r} ({e})"
        ) from None
    with _locked(root / f"{folder.name}.lock"):
        entry = _read(folder)  # another process wrote it while this one waited
        if entry is None:
            entry = _write(folder, source, field, tokenizer, identity, eos)
    return entry


def _read(folder: Path) -> TokenFile | None:
    try:
        with open(folder / "meta.json", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return TokenFile(folder / "tokens.bin", meta["dtype"], int(meta["num_tokens"]))


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(folder: Path, source, field, tokenizer, identity, eos) -> TokenFile:
    dtype = "uint16" if vocab_size(tokenizer) <= 2**16 else "uint32"
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    encode = _byte_ids if identity == BYTE_LEVEL else _encoder(tokenizer)
    tokens = documents = 0
    try:
        with open(tmp / "tokens.bin", "wb") as out:
            for texts, ends in batches(source, field):
                pieces = []
                for ids, end in zip(encode(texts), ends, strict=True):
                    pieces.append(ids)
                    if end and eos is not None:
                        pieces.append(np.array([eos]))
                    documents += end
                if pieces:
                    chunk = np.concatenate(pieces).astype(dtype)
                    out.write(chunk.tobytes())
                    tokens += len(chunk)
        meta = {
            "dtype": dtype,
            "num_tokens": tokens,
            "documents": documents,
            "eos_id": eos,
            "text_field": field,
            "tokenizer": identity,
            "source": source.identity(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"data=hf: {documents} documents, {tokens} tokens, tokenized once into {folder}")
    sys.stdout.flush()
    return TokenFile(folder / "tokens.bin", dtype, tokens)


def _byte_ids(texts: list[str]) -> list[np.ndarray]:
    """The byte-level tokenizer's ids, computed directly: the UTF-8 bytes themselves
    (`tests/test_hf.py` checks them against the tokenizer). A document holding the text
    `<|endoftext|>` keeps it as its 13 bytes here, where the tokenizer would read its token."""
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


def _encoder(tokenizer):
    def encode(texts: list[str]) -> list[np.ndarray]:
        encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encoded]

    return encode


def batches(source, field: str) -> Iterator[tuple[list[str], list[bool]]]:
    """The corpus's texts in order, in batches, each with whether it ends a document: a record
    of JSON lines, Parquet or a saved dataset does; a text file's lines end one at its last."""
    if source.kind == "text":
        for file in source.files:
            yield from _text_lines(file)
        return
    from localsgd.models.hf import offline

    offline()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if source.kind == "disk":
        saved = datasets.load_from_disk(str(source.files[0]))
        if isinstance(saved, datasets.DatasetDict):
            saved = saved[source.split]
        yield from _records(saved.iter(batch_size=BATCH), field, source.files[0])
        return
    for file in source.files:
        stream = datasets.load_dataset(
            source.kind, data_files=[str(file)], split="train", streaming=True
        )
        yield from _records(stream.iter(batch_size=BATCH), field, file)


def _text_lines(file: Path) -> Iterator[tuple[list[str], list[bool]]]:
    """A text file's lines as they are (line endings kept byte for byte: `datasets`' text
    reader would turn \\r\\n into \\n), a batch at a time; the last ends the document."""
    pending: list[str] = []
    try:
        with open(file, encoding="utf-8", newline="") as f:
            for line in f:
                pending.append(line)
                if len(pending) > BATCH:
                    yield pending[:-1], [False] * BATCH
                    pending = pending[-1:]
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"data.path must hold UTF-8 text, got {file} (byte {e.start}: {e.reason})"
        ) from None
    if pending:
        yield pending, [False] * (len(pending) - 1) + [True]


def _records(stream, field: str, file: Path) -> Iterator[tuple[list[str], list[bool]]]:
    for batch in stream:
        texts = batch.get(field)
        if texts is None or any(not isinstance(t, str) for t in texts):
            raise ConfigError(
                f"data.text_field {field!r} must hold text in every record, got a record of "
                f"{file} without it (fields: {', '.join(batch)})"
            )
        yield texts, [True] * len(texts)

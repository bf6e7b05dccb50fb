"""Tokenizers for language-model data, from Hugging Face's `tokenizers` (a Rust library, quick
to import): a local `tokenizer.json`, a byte-level one that needs no file, and a character-level
one for `data=text`'s vocabulary (what `hf/` carries for a model trained on characters).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from localsgd.config import ConfigError

# The byte-level tokenizer: token i is byte i (0-255), then its end-of-text token.
END_OF_TEXT = "<|endoftext|>"
BYTE_LEVEL = "bytes"  # its name in cache keys
# end-of-text tokens under their usual names, looked for in a tokenizer.json (data.eos_token null)
EOS_NAMES = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte: what `tokenizers`' ByteLevel
    pre-tokenizer maps bytes to (the table of the GPT-2 paper's encoder)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """Bytes as tokens: token i is the UTF-8 byte i, 256 is `<|endoftext|>` (257 in all). Any
    text encodes, nothing is unknown, and decoding gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def char_tokenizer(vocab: str):
    """Characters as tokens, token i the i-th character of `vocab` (data=text's ids), so a
    character-level model's `hf/` folder has a tokenizer that reads and writes its text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(vocab)}, unk_token=None))
    # every character its own piece ((?m): `.` matches the newline too, in Oniguruma's syntax)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def load_tokenizer(path: str | None):
    """data.tokenizer: a local tokenizer.json (a file, or a folder holding one), or null for the
    byte-level tokenizer. Returns (tokenizer, its identity for cache keys: the file's hash)."""
    if not path:
        return byte_tokenizer(), BYTE_LEVEL
    file = tokenizer_file(path)
    from tokenizers import Tokenizer

    data = file.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the Rust side raises plain Exceptions
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"data.tokenizer must be a tokenizers tokenizer.json, got {str(path)!r} ({reason})"
        ) from None
    return tokenizer, hashlib.sha256(data).hexdigest()


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json data.tokenizer names; ConfigError (one line) when there is none."""
    file = Path(os.path.expanduser(str(path)))
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(
            f"data.tokenizer must be a local tokenizer.json (or a folder holding one), or null "
            f"for bytes, got {str(path)!r} (no such file)"
        )
    return file


def eos_id(tokenizer, name: str | None) -> int | None:
    """The id appended after each document: `name` (data.eos_token) if given, none for "", else
    the first of the usual end-of-text names the tokenizer knows."""
    if name == "":
        return None
    if name is not None:
        found = tokenizer.token_to_id(name)
        if found is None:
            raise ConfigError(
                f"data.eos_token must be a token of data.tokenizer's vocabulary, or '' for none, "
                f"got {name!r}"
            )
        return found
    for candidate in EOS_NAMES:
        found = tokenizer.token_to_id(candidate)
        if found is not None:
            return found
    return None


def vocab_size(tokenizer) -> int:
    """The ids the tokenizer can give: one more than its largest (added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

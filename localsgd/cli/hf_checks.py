"""The checks of `model=hf` and `data=hf` that need no Hugging Face import and no tokenizing:
run by the launcher's preflight (`localsgd.cli.train.preflight`) before the data and the model
are built, so that a missing file, a missing text field, a tokenizer larger than the model's
vocabulary or a window longer than its positions is refused in one line, before a corpus is
tokenized or `transformers` is imported. The builders (`localsgd.models.hf.causal_lm`,
`localsgd.data.hf.hf_text`) check the same again with the libraries' own reading of the
configs, for every other way of calling them.
"""

from __future__ import annotations

from typing import Any

from localsgd.config import ConfigError, plain

HF_MODEL = "localsgd.models.hf.causal_lm"
HF_DATA = "localsgd.data.hf.hf_text"
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "vocab_size")  # fmt: skip


def _node(cfg: Any, key: str) -> dict:
    node = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    node = plain(node) if node is not None else {}
    return node if isinstance(node, dict) else {}


def check_hf(cfg: Any) -> None:
    """Refuse bad model=hf / data=hf input in one line (ConfigError); a no-op for the rest."""
    model, data = _node(cfg, "model"), _node(cfg, "data")
    is_model, is_data = model.get("_target_") == HF_MODEL, data.get("_target_") == HF_DATA
    if not (is_model or is_data):
        return
    from localsgd.data.hf import check_text_field, find_source
    from localsgd.data.tokens import load_tokenizer, vocab_size
    from localsgd.models.hf import folder_config, positions_of

    data_vocab = None
    if is_data:
        source = find_source(data.get("path", ""), data.get("format", "auto"),
                             data.get("split", "train"))  # fmt: skip
        check_text_field(source, data.get("text_field", "text"))
        tokenizer, _ = load_tokenizer(data.get("tokenizer"))
        data_vocab = vocab_size(tokenizer)
    if not is_model:
        return
    for key in _POSITIVE:
        value = model.get(key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"model.{key} must be an integer >= 1 or null, got {value!r}")
    if model.get("weights") and model.get("config_path"):
        raise ConfigError(
            "model.config_path must be null with model.weights (the weights' folder holds its "
            f"config.json), got {model['config_path']!r}"
        )
    origin = next((k for k in ("weights", "config_path") if model.get(k)), None)
    saved = folder_config(model[origin], origin) if origin else {}

    def given_by(key: str) -> str:  # the setting that gave the model's number
        return f"model.{key}" if model.get(key) or not origin else f"model.{origin}"

    vocab = model.get("vocab_size") or saved.get("vocab_size")
    if data_vocab is not None and isinstance(vocab, int) and vocab < data_vocab:
        raise ConfigError(
            f"{given_by('vocab_size')} gives a vocabulary of {vocab} tokens, smaller than the "
            f"data's tokenizer ({data_vocab} tokens: data.tokenizer); use a larger model "
            f"vocabulary or a smaller tokenizer"
        )
    positions = model.get("max_position_embeddings") or positions_of(saved)
    seq_len = data.get("seq_len")
    if isinstance(positions, int) and isinstance(seq_len, int) and seq_len > positions:
        raise ConfigError(
            f"data.seq_len must be <= the model's {positions} positions "
            f"({given_by('max_position_embeddings')}), got {seq_len}"
        )

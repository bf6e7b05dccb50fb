"""Hugging Face causal language models (`model=hf`): built from a config, never downloaded.

`causal_lm` builds a `transformers` causal LM from one of three sources, and wraps it as every
model here is called, token ids (B, T) -> logits (B, T, V):

- `model.family` (any model type `AutoConfig` knows: llama, gpt2, qwen2, mistral, ...) with the
  size keys (`hidden_size`, `num_hidden_layers`, ...), initialised from the run's seed;
- `model.config_path`: a local folder holding a `config.json` (the size keys override it);
- `model.weights`: a local folder `from_pretrained` loads, to fine-tune (its `config.json` is the
  architecture: a size key that disagrees with it is refused).

Nothing is ever fetched: the Hugging Face libraries are imported with their offline switches set
(`import_transformers`) and folders are read with `local_files_only`. `transformers` is imported
on first use only, so no other run pays its import time.

The training loss is the model's own (`HFCausalLM.lm_loss`: its `loss_function`, Hugging Face's
shifted causal-LM cross-entropy, given the targets already shifted as localsgd's language-model
data holds them). `HFCausalLM.save_pretrained` writes what `AutoModelForCausalLM.from_pretrained`
loads (`localsgd/models/hf_export.py` adds the tokenizer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from localsgd.config import ConfigError

# The switches every Hugging Face library reads: no hub, no telemetry, whatever the environment
# said before.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}

# The size keys of model=hf, in the generic names `PretrainedConfig` maps onto each family's own
# (GPT-2's n_embd, n_layer, ...), and what a model built from scratch takes when a key is null.
SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
)
SCRATCH = {"family": "llama", "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
# the keys a config.json may give the positions under
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")


def offline() -> None:
    os.environ.update(OFFLINE_ENV)


def import_transformers():
    """`transformers`, offline and quiet. torchvision first, the way localsgd.data.vision does:
    transformers imports it, and on torch's CPU wheel that import fails otherwise."""
    offline()
    from localsgd.data.vision import import_torchvision

    import_torchvision()
    import transformers

    transformers.logging.set_verbosity_error()  # its notices would break one-line refusals
    transformers.logging.disable_progress_bar()
    return transformers


def folder_config(path: str, key: str) -> dict:
    """The `config.json` of a local folder named by `model.<key>`, as a dict; ConfigError (one
    line) when the folder or its config is not there. Reads no library: the cheap check."""
    folder = Path(os.path.expanduser(str(path)))
    what = "a model folder from save_pretrained" if key == "weights" else "a config.json"
    if not folder.is_dir():
        raise ConfigError(
            f"model.{key} must be a local directory holding {what} (nothing is downloaded), got "
            f"{str(path)!r} ({'a file' if folder.exists() else 'no such directory'})"
        )
    file = folder / "config.json"
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        reason = "missing" if isinstance(e, FileNotFoundError) else f"unreadable: {e}"
        raise ConfigError(
            f"model.{key} must hold a config.json, got {str(path)!r} ({reason})"
        ) from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(
            f"model.{key} must hold a Hugging Face config.json (with a model_type), got {file}"
        )
    return config


def positions_of(config: Mapping) -> int | None:
    """The positions a config (a dict or a PretrainedConfig) allows, under whichever key its
    family uses; None when it names none (a model without a position limit)."""
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def check_fit(vocab: int, positions: int | None, data_vocab: int, seq_len: int, where: str):
    """The model must hold the data: every token id the tokenizer gives, and data.seq_len
    positions. `where`: the setting that gave the model's numbers."""
    if vocab < data_vocab:
        raise ConfigError(
            f"{where} gives a vocabulary of {vocab} tokens, smaller than the data's tokenizer "
            f"({data_vocab} tokens: data.tokenizer); use a larger model vocabulary or a smaller "
            f"tokenizer"
        )
    if positions is not None and seq_len > positions:
        raise ConfigError(
            f"data.seq_len must be <= the model's {positions} positions ({where}), got {seq_len}"
        )


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM (`self.lm`) as localsgd calls its models: token ids (B, T) ->
    logits (B, T, V), with its own loss (`lm_loss`) and `save_pretrained`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm.train()  # as torch's modules start; from_pretrained gives one in eval mode
        self.max_len = positions_of(lm.config)  # the context `text_sample` generates with

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's own loss function (Hugging Face's shifted causal-LM cross-entropy, mean
        over the tokens, in fp32) of `logits` for the inputs whose next tokens are `targets`:
        `shift_labels` says they are shifted already, as localsgd's LM data gives them."""
        targets = targets.contiguous()  # it views them flat
        return self.lm.loss_function(
            logits=logits.contiguous(),
            labels=targets,
            vocab_size=logits.shape[-1],
            shift_labels=targets,
        )

    def save_pretrained(
        self,
        folder: str,
        state: Mapping[str, torch.Tensor] | None = None,
        config_updates: Mapping[str, Any] | None = None,
    ) -> None:
        """What `AutoModelForCausalLM.from_pretrained(folder)` loads (safetensors and the
        config): `state` (this module's state_dict keys; a sharded model's gathered whole,
        `Sharding.full_state`), else the module's own; `config_updates` (the tokenizer's
        special token ids) into its config. A fresh copy is filled and written, so the training
        module (FSDP-wrapped, views of flat buffers) is not touched."""
        transformers = import_transformers()
        state = self.state_dict() if state is None else state
        own = {k.removeprefix("lm."): v.detach().cpu() for k, v in state.items()}
        config = type(self.lm.config).from_dict(self.lm.config.to_dict())
        config.use_cache = True  # what generate() wants; training ran without the cache
        for key, value in (config_updates or {}).items():
            setattr(config, key, value)
        with torch.device("meta"):  # no initialisation: every weight comes from `state`
            fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # not strict: a tied weight may come under one of its names only; what is left on the
        # meta device after tying had no value
        loaded = fresh.load_state_dict(own, strict=False, assign=True)
        fresh.tie_weights()
        missing = [n for n, t in fresh.state_dict().items() if t.is_meta]
        if missing or loaded.unexpected_keys:
            raise ValueError(
                f"save_pretrained: the state does not fit {type(fresh).__name__} (no value for "
                f"{missing[:4]}, unknown {loaded.unexpected_keys[:4]})"
            )
        # non-persistent buffers (rotary frequencies) are rebuilt on load: not saved
        fresh.save_pretrained(folder, safe_serialization=True)


def causal_lm(
    num_classes: int,
    input_shape: Sequence[int],
    task: str = "lm",
    family: str | None = None,
    hidden_size: int | None = None,
    num_hidden_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    config: Mapping[str, Any] | None = None,
    config_path: str | None = None,
    weights: str | None = None,
    attn_implementation: str = "sdpa",
) -> HFCausalLM:
    """A Hugging Face causal LM for token data of `num_classes` token ids in windows of
    `input_shape` = (seq_len,) (what `localsgd.models.build_model` offers). See the module
    docstring for the sources; `config`: any other key of the family's config (`rope_theta`,
    `attention_dropout`, ...). Refuses, in one line, a vocabulary smaller than the data's or
    fewer positions than data.seq_len."""
    if task != "lm" or len(input_shape) != 1:
        raise ConfigError(
            f"model=hf needs token sequences (task 'lm': data=hf, data=text), got task {task!r} "
            f"with input shape {tuple(input_shape)}"
        )
    if config_path and weights:
        raise ConfigError(
            "model.config_path must be null with model.weights (the weights' folder holds its "
            f"config.json), got {config_path!r}"
        )
    sizes = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
    }
    given = {k: v for k, v in sizes.items() if v is not None}
    extra = dict(config or {})
    transformers = import_transformers()
    seq_len = int(input_shape[0])
    if weights:
        return _pretrained(transformers, weights, family, given, extra, attn_implementation,
                           num_classes, seq_len)  # fmt: skip
    if config_path:
        base = folder_config(config_path, "config_path")
        family = _same_family(family, base["model_type"], "config_path")
        kwargs = {k: v for k, v in base.items() if k not in ("model_type", "architectures")}
        where = "model.config_path"
    else:
        family = family or SCRATCH["family"]
        kwargs = {k: v for k, v in SCRATCH.items() if k != "family"}
        kwargs["max_position_embeddings"] = seq_len
        kwargs["vocab_size"] = num_classes
        where = "model.family"
    kwargs.update(given)
    kwargs.update(extra)
    if "vocab_size" in given:
        where = "model.vocab_size"
    hf_config = _family_config(transformers, family, kwargs, given)
    if not config_path:
        _fill_defaults(hf_config, {**given, **extra})
    hf_config._attn_implementation = attn_implementation
    hf_config.use_cache = False
    check_fit(hf_config.vocab_size, positions_of(hf_config), num_classes, seq_len, where)
    try:
        lm = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.family {family!r} builds no causal LM: {reason}") from None
    return HFCausalLM(lm)


def _same_family(family: str | None, found: str, key: str) -> str:
    if family is not None and family != found:
        raise ConfigError(
            f"model.family must be null or {found!r} with model.{key} (its config.json's "
            f"model_type), got {family!r}"
        )
    return found


def _family_config(transformers, family: str, kwargs: dict, given: dict):
    """The family's config class filled from `kwargs`; a size key the user set that the family
    has no name for (GPT-2 has no num_key_value_heads) is refused, a default one dropped."""
    try:
        cls = transformers.AutoConfig.for_model(family).__class__
    except ValueError:
        known = ", ".join(("llama", "gpt2", "qwen2", "mistral", "..."))
        raise ConfigError(
            f"model.family must be a model type transformers' AutoConfig knows ({known}), got "
            f"{family!r}"
        ) from None
    names = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    for key in [k for k in SIZE_KEYS if k in kwargs and k not in names]:
        if key in given:
            raise ConfigError(
                f"model.{key} is no setting of {family}'s config ({cls.__name__}); set its own "
                f"key under model.config instead (e.g. +model.config.n_inner=512 for gpt2)"
            )
        kwargs.pop(key)
    return cls(**kwargs)


def _fill_defaults(config, given: dict) -> None:
    """From scratch, the keys a family leaves at sizes of its own: key/value heads as many as
    the attention heads (grouped-query attention only when asked for), an MLP 4x wide; special
    token ids outside the vocabulary (GPT-2's 50256) dropped."""
    if "num_key_value_heads" not in given and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads
    if "intermediate_size" not in given and "intermediate_size" in config.to_dict():
        config.intermediate_size = 4 * config.hidden_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not 0 <= value < config.vocab_size:
            setattr(config, key, None)


def _pretrained(transformers, weights, family, given, extra, attn, data_vocab, seq_len):
    """`from_pretrained` of a local folder, in fp32; every size key must agree with it."""
    base = folder_config(weights, "weights")
    _same_family(family, base["model_type"], "weights")
    cls = transformers.AutoConfig.for_model(base["model_type"]).__class__
    saved = cls.from_dict({k: v for k, v in base.items() if k != "model_type"})
    for key, value in given.items():
        if getattr(saved, key, None) != value:
            raise ConfigError(
                f"model.{key} must be null or {getattr(saved, key, None)!r} with model.weights "
                f"(its config.json), got {value!r}"
            )
    check_fit(saved.vocab_size, positions_of(saved), data_vocab, seq_len, "model.weights")
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(str(weights)),
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation=attn,
            use_cache=False,
            **extra,
        )
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.weights {weights!r} does not load: {reason}") from None
    return HFCausalLM(lm)

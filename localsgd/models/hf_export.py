"""`hf/`: a model=hf run's model as Hugging Face loads it, with its tokenizer.

`write_hf` is what the trainer calls at the end of every model=hf run (sharded runs with the
state gathered whole) and what `python -m localsgd.export` calls for a finished run or a
checkpoint (localsgd/cli/export.py): `save_pretrained` safetensors and config, and the data's
tokenizer as a `PreTrainedTokenizerFast` (`tokenizer.json` + `tokenizer_config.json`), so that

    AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    AutoTokenizer.from_pretrained(run_dir / "hf")

load them with no code of localsgd's. The folder is written beside its place and renamed into
it, so a reader never sees half of one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch

from localsgd.data.tokens import char_tokenizer, eos_id
from localsgd.models.hf import HFCausalLM, import_transformers

HF_DIR = "hf"


def tokenizer_of(data: Any):
    """The data's tokenizer (data=hf), or a character-level one for a character vocabulary
    (data=text, data=shakespeare), or None (a dataset of token ids with neither)."""
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    vocab = getattr(data, "vocab", "")
    return char_tokenizer(vocab) if vocab else None


def write_hf(
    model: HFCausalLM, data: Any, folder: str, state: Mapping[str, torch.Tensor] | None = None
) -> str:
    """`model` (or `state`, its state_dict keys) and the data's tokenizer into `folder`."""
    transformers = import_transformers()
    tokenizer = tokenizer_of(data)
    eos = getattr(data, "eos_id", None)
    if eos is None and tokenizer is not None:
        eos = eos_id(tokenizer, None)
    eos_name = tokenizer.id_to_token(eos) if tokenizer is not None and eos is not None else None
    # generate() stops at the end-of-text token and pads with it (a model of one sequence)
    special = {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}
    if eos is None:  # nothing to stop or pad with: none of the family's defaults either
        special = dict.fromkeys(special)
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state, special)
        if tokenizer is not None:
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_object=tokenizer,
                eos_token=eos_name,
                pad_token=eos_name,
                model_max_length=model.max_len or int(1e30),
            )
            fast.save_pretrained(tmp)
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

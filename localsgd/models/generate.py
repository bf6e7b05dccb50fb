"""Text from a trained language model, to show what a loss means."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt: list[int],
    n_tokens: int,
    context: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> list[int]:
    """`n_tokens` token ids sampled one at a time from `model` (ids (1, T) -> logits (1, T, V))
    after `prompt`, each conditioned on at most the last `context` tokens, at `temperature`
    (0: greedy), with a private generator seeded by `seed` so that the global RNG streams are
    untouched."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt or [0]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = []
    for _ in range(n_tokens):
        logits = model(ids[:, -context:])[0, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(int(nxt))
    model.train(was_training)
    return out


def generate_text(
    model: nn.Module,
    vocab: str,
    n_chars: int,
    context: int,
    prompt: str = "\n",
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """`n_chars` characters from a character-level model whose token i is `vocab[i]`."""
    lookup = {ch: i for i, ch in enumerate(vocab)}
    start = [lookup[ch] for ch in prompt if ch in lookup]
    ids = generate_ids(model, start, n_chars, context, temperature, seed)
    return "".join(vocab[i] for i in ids)


def generate_decoded(
    model: nn.Module,
    tokenizer,
    n_tokens: int,
    context: int,
    prompt: str = "\n",
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """`n_tokens` tokens from a model of a `tokenizers` tokenizer's ids (data=hf), decoded."""
    start = tokenizer.encode(prompt, add_special_tokens=False).ids
    ids = generate_ids(model, start, n_tokens, context, temperature, seed)
    return tokenizer.decode(ids, skip_special_tokens=False)

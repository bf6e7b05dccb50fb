"""Text from a trained character-level language model, to show what a loss means."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate_text(
    model: nn.Module,
    vocab: str,
    n_chars: int,
    context: int,
    prompt: str = "\n",
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """`n_chars` characters sampled one at a time from `model` (ids (1, T) -> logits (1, T, V)),
    each conditioned on at most the last `context` characters, at `temperature` (0: greedy), with
    a private generator seeded by `seed` so that the global RNG streams are untouched."""
    lookup = {ch: i for i, ch in enumerate(vocab)}
    device = next(model.parameters()).device
    ids = torch.tensor([[lookup[ch] for ch in prompt if ch in lookup] or [0]], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = []
    for _ in range(n_chars):
        logits = model(ids[:, -context:])[0, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(vocab[int(nxt)])
    model.train(was_training)
    return "".join(out)

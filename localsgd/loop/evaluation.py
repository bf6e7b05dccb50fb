"""The loss every task trains on, and the evaluation of a model on a held-out split."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from localsgd.data import task_of
from localsgd.models.generate import generate_decoded, generate_text


def loss_and_correct(
    logits: torch.Tensor, targets: torch.Tensor, model: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over classes, for (B, C) class logits and (B, T, V) token logits alike; or
    the loss of `model`'s own `lm_loss(logits, targets)` where it has one (model=hf: the Hugging
    Face model's shifted cross-entropy)."""
    own = getattr(model, "lm_loss", None)
    loss = own(logits, targets) if own is not None else None
    logits, targets = logits.flatten(0, -2), targets.flatten()
    if loss is None:
        loss = F.cross_entropy(logits, targets)
    return loss, (logits.argmax(-1) == targets).sum()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    autocast: Callable[[], AbstractContextManager],
    task: str = "classification",
    split: str = "test",
) -> dict[str, float]:
    """The loss (nats per target, i.e. per character for character-level LMs) and accuracy over
    `batches`, plus perplexity for language models, named for their `split` (`test_loss`,
    `val_loss`, ...). `autocast`: the training precision's context, so a model is evaluated in
    the precision it trains in."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for x, y in batches:
        with autocast():
            logits = model(x)
        loss, right = loss_and_correct(logits.float(), y, model)
        total_loss += loss.item() * y.numel()
        correct += int(right)
        count += y.numel()
    model.train()
    result = {f"{split}_loss": total_loss / count, f"{split}_accuracy": correct / count}
    if task == "lm":  # no overflow
        result[f"{split}_perplexity"] = math.exp(min(result[f"{split}_loss"], 700.0))
    return result


@torch.no_grad()
def held_out_loss(
    model: nn.Module,
    test,
    seed: int,
    round_: int,
    batch_size: int,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    samples: slice | None = None,
) -> torch.Tensor:
    """The model's loss per sample (float64, on the CPU; a sequence's mean over its tokens),
    as it stands, on `batch_size` samples of `test` drawn from round `round_`'s seed: the same
    batch on every rank, a different one each round (`sync.score`,
    localsgd.averaging.trust.trusted_round).
    The trainer passes the validation split, which no worker trains on (the test split only
    with data.val_fraction=0: then a scored run's verdicts have seen part of the test set).
    `samples`: only that part of the batch (the judge splits an evaluation by samples across
    the group)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_)
    picks = torch.randint(len(test), (batch_size,), generator=gen).tolist()
    if samples is not None:
        picks = picks[samples]
        if not picks:
            return torch.zeros(0, dtype=torch.float64)
    x, y = default_collate([test[i] for i in picks])
    training = model.training
    model.eval()
    with autocast():
        logits = model(x.to(device))
    model.train(training)
    y = y.to(device)
    own = getattr(model, "lm_loss", None)
    if own is not None:  # the model's own loss, sample by sample
        logits = logits.float()
        losses = torch.stack([own(logits[i : i + 1], y[i : i + 1]) for i in range(len(picks))])
        return losses.double().cpu()
    losses = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none")
    return losses.view(len(picks), -1).mean(1).double().cpu()


def text_sample(model: nn.Module, data, chars: int, seed: int) -> dict[str, str]:
    """A generated sample of `chars` characters for character-level language models (data with
    a vocabulary), of `chars` tokens decoded for tokenized ones (data with a tokenizer), else
    nothing. (A sharded model: every rank of its replica group calls it.)"""
    vocab, tokenizer = getattr(data, "vocab", ""), getattr(data, "tokenizer", None)
    if task_of(data) != "lm" or not (vocab or tokenizer) or chars == 0:
        return {}
    context = getattr(model, "max_len", None) or data.test[0][0].shape[-1]
    if not vocab:
        return {"sample": generate_decoded(model, tokenizer, chars, context, seed=seed)}
    return {"sample": generate_text(model, vocab, chars, context, seed=seed)}

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
from localsgd.models.generate import generate_text


def loss_and_correct(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over classes, for (B, C) class logits and (B, T, V) token logits alike."""
    logits, targets = logits.flatten(0, -2), targets.flatten()
    return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).sum()


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
        loss, right = loss_and_correct(logits.float(), y)
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
    batch on every rank, a different one each round (`sync.score`, localsgd.averaging.trust).
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
    losses = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none")
    return losses.view(len(picks), -1).mean(1).double().cpu()


def text_sample(model: nn.Module, data, chars: int, seed: int) -> dict[str, str]:
    """A generated sample of `chars` characters for character-level language models (data with
    a vocabulary), else nothing. (A sharded model: every rank of its replica group calls it.)"""
    vocab = getattr(data, "vocab", "")
    if task_of(data) != "lm" or not vocab or chars == 0:
        return {}
    context = getattr(model, "max_len", None) or data.test[0][0].shape[-1]
    return {"sample": generate_text(model, vocab, chars, context, seed=seed)}

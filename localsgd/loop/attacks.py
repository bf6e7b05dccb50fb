"""Attacks on the average, as trainer callbacks (`trainer.callbacks`): one worker sends a bad
contribution at every sync, to test and study robust aggregation (docs/reliability.md).

A contribution is a worker's change since the last sync, `local - anchor`; the attacker keeps
its own copy of the anchor (its model right after each sync, identical on every worker) and,
just after the optimizer step of a step that syncs over every worker, rewrites its parameters
so that the averager sends the attack's change instead:

- `sign_flip`: `-scale` times its true change (`scale` 10 by default);
- `noise`: Gaussian noise of `scale` times the true change's norm (per coordinate, the noise
  has standard deviation `scale * ||change|| / sqrt(n)`), in place of the change;
- `stale`: the change it sent at its first round after `start_step`, replayed at every later
  round;
- `nan`: its true change with one value made NaN;
- `zeros`: no change (a free rider that trains nothing into the average).

`every` = k attacks at the first of every k syncs and sends the true change at the others (an
intermittent attacker, which never runs up a streak of bad rounds: `sync.exclude_window`).

In post-local SGD's synchronous warmup (`sync.warmup_steps`) every step's gradients are
averaged instead: there the attacker rewrites its gradients, just before they are averaged, by
the same rule (`stale`: its first attacked gradient replayed). Under `ft=torchft` the warmup's
gradients go through torchft's all-reduce and are not attacked.

From the command line, for rank 1 from step 0:
`'trainer.callbacks=[{_target_:localsgd.loop.attacks.Attack,kind:sign_flip,rank:1}]'`.
The attacker's own parameters are what it sends; after the sync it holds the common model like
every worker. Under Streaming DiLoCo's fragments (`sync.fragments > 1`) a sync sends one
fragment's pseudo-gradient, `anchor - local`, against that fragment's anchor (identical on every
worker, `Averager.global_state`), and the rest of the model keeps its local progress: the attack
rewrites only the parameters of the fragment that syncs, against that anchor, so it sends the
attack's change at every fragment sync and its other fragments train on untouched (`stale`
replays each fragment's own first change). Floating-point buffers (BatchNorm statistics) are
left alone. An attack is a test tool and keeps its state in memory only: a resumed attacker
takes its model at its first step as the anchor (right after a sync, the true one) and starts a
stale replay afresh.
"""

from __future__ import annotations

import math

import torch

from localsgd.averaging.flat import local_tensor

ATTACKS = ("sign_flip", "noise", "stale", "nan", "zeros")


class Attack:
    """Makes worker `rank` send a `kind` contribution at every sync over every worker after
    `start_step` (see the module doc)."""

    def __init__(
        self,
        kind: str,
        rank: int = 1,
        start_step: int = 0,
        scale: float | None = None,
        seed: int = 0,
        every: int = 1,
    ):
        if isinstance(kind, float) and math.isnan(kind):
            kind = "nan"  # Hydra reads an unquoted `kind:nan` as the float NaN
        if kind not in ATTACKS:
            raise ValueError(f"attack kind must be one of {', '.join(ATTACKS)}, got {kind!r}")
        self.kind, self.rank, self.start_step = kind, int(rank), int(start_step)
        self.scale = float(scale) if scale is not None else (10.0 if kind == "sign_flip" else 1.0)
        if int(every) < 1:
            raise ValueError(f"attack every must be an integer >= 1 (syncs), got {every!r}")
        self.every = int(every)  # attack every `every`-th sync, behave at the others
        self.syncs = 0  # syncs over every worker seen after start_step
        self.generator = torch.Generator().manual_seed(seed)
        self.anchor: list[torch.Tensor] | None = None
        # per fragment (None: the model; "warmup": the warmup's gradients)
        self.replay: dict[int | str | None, list[torch.Tensor]] = {}
        self.rounds = 0  # contributions rewritten so far
        self._hook = None
        self._trainer = None

    def on_step_start(self, trainer, step: int) -> None:
        if trainer.info.rank != self.rank or self._hook is not None:
            return
        self._trainer = trainer
        self._remember(trainer)  # the model every worker starts from
        self._hook = trainer.optimizer.register_step_post_hook(lambda *_: self._tamper())
        trainer.sync.add_gradient_hook(self._tamper_gradients)  # the warmup's, if any

    def on_step_end(self, trainer, step: int) -> None:
        if trainer.info.rank == self.rank and trainer.in_sync:
            self._remember(trainer)  # the common model after the sync

    def _params(self, trainer) -> list[torch.Tensor]:
        return [local_tensor(p) for p in trainer.model.parameters()]

    def _remember(self, trainer) -> None:
        self.anchor = [p.detach().clone() for p in self._params(trainer)]

    @torch.no_grad()
    def _tamper(self) -> None:
        trainer = self._trainer
        step = trainer.step
        if step < self.start_step or trainer.sync.in_warmup:
            return
        sent = trainer.sync.contribution_at(step)  # what this worker is about to send
        if sent is None:
            return
        self.syncs += 1
        if (self.syncs - 1) % self.every:
            return  # an intermittent attacker sends its true change at this sync
        fragment, params, anchor = self._sent(trainer, sent)
        changes = [p - a for p, a in zip(params, anchor, strict=True)]
        sent = self._attacked(changes, fragment)
        for p, a, s in zip(params, anchor, sent, strict=True):
            p.copy_(a + s)
        self.rounds += 1

    @torch.no_grad()
    def _tamper_gradients(self, grads: list[torch.Tensor]) -> None:
        """In the warmup: this step's gradients rewritten by the attack's rule."""
        trainer = self._trainer
        if trainer.step < self.start_step:
            return
        self.syncs += 1
        if (self.syncs - 1) % self.every:
            return
        sent = self._attacked(grads, "warmup")
        for g, s in zip(grads, sent, strict=True):
            g.copy_(s)
        self.rounds += 1

    def _attacked(self, changes: list[torch.Tensor], key) -> list[torch.Tensor]:
        """What the attack sends in place of `changes` (new tensors); `stale` replays the first
        it was given under `key` (a fragment, None for the model, "warmup" for gradients)."""
        if self.kind == "stale":
            return self.replay.setdefault(key, [c.clone() for c in changes])
        if self.kind == "sign_flip":
            return [c.mul(-self.scale) for c in changes]
        if self.kind == "noise":
            n = sum(c.numel() for c in changes)
            norm = math.sqrt(sum(float(c.double().square().sum()) for c in changes))
            std = self.scale * norm / math.sqrt(max(n, 1))
            return [torch.randn(c.shape, generator=self.generator).mul_(std).to(c)
                    for c in changes]  # fmt: skip
        if self.kind == "nan":
            sent = [c.clone() for c in changes]
            sent[0].view(-1)[0] = float("nan")
            return sent
        return [torch.zeros_like(c) for c in changes]  # zeros

    def _sent(self, trainer, sent):
        """(fragment, parameters, anchors) of what the sync sends (`Synchroniser.
        contribution_at`): the whole model against the model after the last sync (fragment
        None), or, under Streaming DiLoCo's fragments, the syncing fragment's parameters
        against that fragment's anchor (plain streaming keeps none: the model after its last
        sync, as this attacker remembers it)."""
        if sent.fragment is None:
            return None, self._params(trainer), self.anchor
        if sent.anchors is not None:
            return sent.fragment, sent.params, sent.anchors
        # keyed by the parameter itself: a sharded one's local shard is a new tensor each call
        model = trainer.model.parameters()
        remembered = {id(p): a for p, a in zip(model, self.anchor, strict=True)}
        return sent.fragment, sent.params, [remembered[id(p)] for p in sent.parameters]

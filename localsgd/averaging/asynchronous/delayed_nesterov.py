"""Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling",
arXiv 2401.09135): the outer step of asynchronous rounds, where each merge's pseudo-gradient may
be stale (trained from an older global model).

The paper's server takes one worker's pseudo-gradient at a time: the outer momentum moves only
once every N of them (a cycle), by their mean, and each one in between steps plainly by
lr x g / N, so a cycle moves the model about as far as one synchronous Nesterov step on the
mean, without momentum compounding each stale direction. A merge here may combine k
contributions at once (a quorum, or several workers arriving together), with mean g: it counts
as k of the cycle's N and steps plainly by lr x g x k / max(N, k); the merge that completes a
cycle (its count reaching N) moves the momentum by the mean of the cycle's contributions and
adds it:

    m <- beta m + (sum of the cycle's contributions) / (their count)
    theta <- theta - lr (g k / max(N, k) + beta m)

So a merge of every worker at once (k = N = the workers) is torch's Nesterov SGD step on their
mean, and with N = 1 each merge is one, op for op (`torch.optim.SGD(nesterov=True)`).

With `nesterov=False` (SlowMo's heavy-ball slow momentum) the same cycle moves the model by the
momentum before it takes the cycle's mean, as torch's heavy-ball step does:

    theta <- theta - lr (g k / max(N, k) + beta m);    m <- beta m + (the cycle's mean)

(computed as `m' + g k / max(N, k) - mean` from the new m', which is the same sum)

so k = N is torch's `SGD(momentum=beta)` step on the mean, and N = 1 is that step op for op.
"""

from __future__ import annotations

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """The outer optimizer over the global model's parameters (`lr`, `momentum` beta,
    `delay` N >= 1). Set `contributions` (k, default 1) before each `step`. The cycle's count
    lives in the param group and the buffers in `state`, so `state_dict` checkpoints them."""

    def __init__(self, params, lr: float, momentum: float, delay: int, nesterov: bool = True):
        if delay < 1:
            raise ValueError(f"sync.outer_delay must be >= 1, got {delay}")
        defaults = {"lr": lr, "momentum": momentum, "delay": delay, "nesterov": nesterov}
        super().__init__(params, defaults)
        self.contributions = 1

    @torch.no_grad()
    def step(self, closure=None):
        k = self.contributions
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["delay"]
            nesterov = group.get("nesterov", True)
            count = group.get("cycle", 0) + k
            moves = count >= n
            group["cycle"] = 0 if moves else count
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if n == 1 and k == 1:  # torch's SGD, op for op
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.clone()
                    else:
                        state["momentum_buffer"].mul_(beta).add_(g)
                    buf = state["momentum_buffer"]
                    p.add_(g.add(buf, alpha=beta) if nesterov else buf, alpha=-lr)
                    continue
                if "pending" not in state:  # (a momentum loaded from torch's SGD carries on)
                    state["pending"] = torch.zeros_like(g)
                    state.setdefault("momentum_buffer", torch.zeros_like(g))
                pending, buf = state["pending"], state["momentum_buffer"]
                pending.add_(g, alpha=k)
                plain = k / max(n, k)
                if moves and nesterov:
                    buf.mul_(beta).add_(pending, alpha=1 / count)
                    p.add_(g.mul(plain).add_(buf, alpha=beta), alpha=-lr)
                    pending.zero_()
                elif moves:  # heavy-ball: lr (g plain + beta m), m then taking the mean
                    mean = pending.div_(count)
                    buf.mul_(beta).add_(mean)  # torch's order: at k = N the step is its own
                    p.add_(buf.add(g.mul(plain).sub_(mean)), alpha=-lr)
                    pending.zero_()
                else:
                    p.add_(g, alpha=-lr * plain)

"""Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling",
arXiv 2401.09135): the outer step of asynchronous rounds, where each merge's pseudo-gradient may
be stale (trained from an older global model).

The outer momentum moves only every `delay` (N) merges, by the mean of the pseudo-gradients
buffered since it last moved; in between each merge steps plainly, lr x g / N. At the merge
that completes a cycle of N:

    m <- beta m + (g_1 + ... + g_N) / N
    theta <- theta - lr (g_N / N + beta m)

and at the others theta <- theta - lr g / N. With N = 1 this is torch's Nesterov SGD step, op
for op (`torch.optim.SGD(nesterov=True)`), so one momentum step a merge; a larger N keeps the
momentum from compounding stale directions, which is where asynchronous DiLoCo with plain
Nesterov momentum falls behind its synchronous counterpart (the paper's finding).
"""

from __future__ import annotations

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """The outer optimizer over the global model's parameters (`lr`, `momentum` beta,
    `delay` N >= 1). The merge count lives in the param group (`outer_rounds`, set by
    `localsgd.averaging.rounds.outer_step`) and the buffers in `state`, so `state_dict`
    checkpoints everything."""

    def __init__(self, params, lr: float, momentum: float, delay: int, nesterov: bool = True):
        if delay < 1:
            raise ValueError(f"sync.outer_delay must be >= 1, got {delay}")
        if not nesterov:
            raise ValueError("Delayed Nesterov is a Nesterov step: set sync.outer_nesterov=true")
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta, n = group["lr"], group["momentum"], group["delay"]
            # outer_step counted this merge already; without it (a bare call) count here
            count = group.get("outer_rounds", group.setdefault("merges", 0) + 1)
            group["merges"] = count
            moves = count % n == 0
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if n == 1:  # torch's SGD, op for op
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.clone()
                    else:
                        state["momentum_buffer"].mul_(beta).add_(g)
                    p.add_(g.add(state["momentum_buffer"], alpha=beta), alpha=-lr)
                    continue
                sum_ = state.get("pending")
                if sum_ is None:
                    sum_ = state["pending"] = torch.zeros_like(g)
                    state["momentum_buffer"] = torch.zeros_like(g)
                sum_.add_(g)
                if moves:
                    buf = state["momentum_buffer"]
                    buf.mul_(beta).add_(sum_, alpha=1 / n)
                    p.add_(g.div(n).add_(buf, alpha=beta), alpha=-lr)
                    sum_.zero_()
                else:
                    p.add_(g, alpha=-lr / n)

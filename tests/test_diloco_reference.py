"""`OuterAverager` against DiLoCo's Algorithm 1 (Douillard et al. 2023), written from the paper
as a single process that holds every worker, to the last bit.

Algorithm 1: for each outer step t, every worker i starts from theta(t-1), takes its inner steps
with its own InnerOpt (AdamW, whose state it keeps across outer steps), and returns
delta_i = theta(t-1) - theta_i; the outer gradient is Delta = mean_i delta_i, and
theta(t) = OuterOpt(theta(t-1), Delta), OuterOpt being SGD with Nesterov momentum.

The rounds are as long as the averager's schedule says, which is torch's step rule: the first
average comes after step 0 (one inner step), then every H steps. With 2 workers the mean is
(delta_0 + delta_1) / 2 in either summation order, so the two must agree bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from localsgd.cli.launch import run_on_workers

H, ROUNDS, WORKERS = 4, 5, 2
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
INNER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _inner_step(model, opt, worker: int, step: int) -> None:
    x, y = _batch(worker, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _steps() -> int:
    return 1 + H * (ROUNDS - 1)  # averages after steps 0, H, 2H, ...


def _ours(rank: int, world_size: int) -> list[torch.Tensor]:
    from localsgd.averaging import OuterAverager

    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **INNER)
    averager = OuterAverager(
        H, module=model, outer_lr=OUTER["lr"], outer_momentum=OUTER["momentum"]
    )
    for step in range(_steps()):
        _inner_step(model, opt, rank, step)
        averager.maybe_average()
    return [p.detach().clone() for p in model.parameters()]


def _algorithm_1(outer: dict = OUTER) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    theta = _model()  # theta(0), the outer parameters
    outer_opt = torch.optim.SGD(theta.parameters(), **outer)
    workers = [copy.deepcopy(theta) for _ in range(WORKERS)]
    inner = [torch.optim.AdamW(w.parameters(), **INNER) for w in workers]
    step = 0
    for t in range(ROUNDS):
        inner_steps = 1 if t == 0 else H
        deltas = []
        for i, (worker, opt) in enumerate(zip(workers, inner, strict=True)):
            with torch.no_grad():
                for p, q in zip(worker.parameters(), theta.parameters(), strict=True):
                    p.copy_(q)  # theta_i(t) <- theta(t-1)
            for h in range(inner_steps):
                _inner_step(worker, opt, i, step + h)
            deltas.append(
                [
                    q.detach() - p.detach()
                    for p, q in zip(worker.parameters(), theta.parameters(), strict=True)
                ]
            )
        step += inner_steps
        for k, q in enumerate(theta.parameters()):
            total = deltas[0][k].clone()
            for d in deltas[1:]:
                total.add_(d[k])
            q.grad = total.div_(WORKERS)  # Delta(t) = mean_i delta_i(t)
        outer_opt.step()  # theta(t) <- OuterOpt(theta(t-1), Delta(t))
    return [p.detach().clone() for p in theta.parameters()]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_outer_averager_is_algorithm_1_to_the_last_bit():
    ranks = run_on_workers(_ours, WORKERS)
    reference = _algorithm_1()
    for got in ranks:
        for a, b in zip(got, reference, strict=True):
            assert torch.equal(a, b)
    # the outer step is doing something: plain averaging (outer lr 1, no momentum) differs
    plain = _algorithm_1({"lr": 1.0, "momentum": 0.0, "nesterov": False})
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(ranks[0], plain, strict=True))

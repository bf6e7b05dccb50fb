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


def _ours(rank: int, world_size: int, warmup: int = 0, streaming: bool = False) -> list:
    from localsgd.averaging import OuterAverager, StreamingAverager

    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **INNER)
    kind = StreamingAverager if streaming else OuterAverager
    averager = kind(
        H,
        module=model,
        outer_lr=OUTER["lr"],
        outer_momentum=OUTER["momentum"],
        outer_warmup_rounds=warmup,
    )
    for step in range(_steps()):
        _inner_step(model, opt, rank, step)
        averager.maybe_average()
        if warmup and step == H + 1:  # mid-warmup: a resumed averager counts on from its state
            state = averager.state_dict()
            averager = kind(  # not init_sync: the ranks' local models differ mid-round
                H,
                module=model,
                outer_lr=OUTER["lr"],
                outer_momentum=OUTER["momentum"],
                outer_warmup_rounds=warmup,
                init_sync=False,
            )
            averager.load_state_dict(state)
    return [p.detach().clone() for p in model.parameters()]


def _algorithm_1(outer: dict = OUTER, warmup: int = 0) -> list[torch.Tensor]:
    """`warmup` = R: outer step t < R takes lr 1 + (t/R)(lr - 1) and momentum (t/R) momentum,
    interpolating from plain averaging (lr 1, no momentum) to OuterOpt."""
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
        if warmup:
            f = min(1.0, t / warmup)
            outer_opt.param_groups[0]["lr"] = 1.0 + f * (outer["lr"] - 1.0)
            outer_opt.param_groups[0]["momentum"] = f * outer["momentum"]
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


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("streaming", [False, True], ids=["outer", "streaming_p1"])
def test_the_outer_warmup_is_its_formula_to_the_last_bit_through_a_resume(streaming):
    """`outer_warmup_rounds=3`: outer steps 0, 1, 2 interpolate from a plain average to DiLoCo's
    step, from step 3 on it is DiLoCo's; the count survives a state_dict round trip."""
    ranks = run_on_workers(_ours, WORKERS, 3, streaming)
    reference = _algorithm_1(warmup=3)
    for got in ranks:
        for a, b in zip(got, reference, strict=True):
            assert torch.equal(a, b)
    for other in (_algorithm_1(), _algorithm_1(warmup=2)):  # the warmup and its length matter
        assert any((a - b).abs().max() > 1e-6 for a, b in zip(ranks[0], other, strict=True))

"""The averaging core against torch's reference averagers and the algorithm's definition."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from localsgd.averaging import CommStats, GradientAverager, PeriodicAverager
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _sgd_step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _parity_worker(rank, world_size, period, warmup, steps):
    ours_model, torch_model = _model(), _model()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1, momentum=0.9)
    ours = PeriodicAverager(period, warmup, module=ours_model)
    with warnings.catch_warnings():  # torch discourages period=1, which we test on purpose
        warnings.simplefilter("ignore")
        reference = PeriodicModelAverager(period=period, warmup_steps=warmup)
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    decisions = []
    for _ in range(steps):
        x, y = _batch(gen)
        _sgd_step(ours_model, ours_opt, x, y)
        _sgd_step(torch_model, torch_opt, x, y)
        decisions.append(ours.maybe_average())
        reference.average_parameters(torch_model.parameters())
    state = ours.state_dict()
    assert state["step"] == reference.step == steps
    return {
        "ours": [p.detach().clone() for p in ours_model.parameters()],
        "torch": [p.detach().clone() for p in torch_model.parameters()],
        "decisions": decisions,
        "rounds": ours.stats.rounds,
        "bytes": ours.stats.bytes,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world_size,period,warmup,steps", [(4, 3, 2, 13), (2, 1, 0, 6), (2, 4, 5, 17)]
)
def test_matches_torch_periodic_model_averager(world_size, period, warmup, steps):
    results = run_distributed(_parity_worker, world_size, period, warmup, steps)
    expected = [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    numel = sum(p.numel() for p in _model().parameters())
    for r in results:
        assert r["decisions"] == expected
        assert r["rounds"] == sum(expected) and r["bytes"] == 4 * numel * sum(expected)
        for ours, ref in zip(r["ours"], r["torch"], strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # After a local last step the replicas must differ: the comparison above is not vacuous.
    last_local = not expected[-1]
    assert last_local == any(
        not torch.equal(a, b) for a, b in zip(results[0]["ours"], results[1]["ours"], strict=True)
    )


def _k1_worker(rank, world_size, steps):
    local_model, sync_model = _model(), _model()
    local_opt = torch.optim.SGD(local_model.parameters(), lr=0.2)
    sync_opt = torch.optim.SGD(sync_model.parameters(), lr=0.2)
    averager = PeriodicAverager(1, module=local_model)
    grads = GradientAverager(sync_model, stats=CommStats())
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        x, y = _batch(gen)
        _sgd_step(local_model, local_opt, x, y)
        averager.maybe_average()
        sync_opt.zero_grad()  # set_to_none=True: the averager must still see the new gradients
        torch.nn.functional.cross_entropy(sync_model(x), y).backward()
        grads.all_reduce()
        sync_opt.step()
    return {
        "local": [p.detach().clone() for p in local_model.parameters()],
        "sync": [p.detach().clone() for p in sync_model.parameters()],
        "start": [p.detach().clone() for p in _model().parameters()],
    }


@pytest.mark.timeout(120)
def test_k1_local_sgd_equals_synchronous_sgd():
    results = run_distributed(_k1_worker, 2, 10)
    for r in results:
        for local, sync, start in zip(r["local"], r["sync"], r["start"], strict=True):
            torch.testing.assert_close(local, sync, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(local, start)  # training moved the model


def _views_worker(rank, world_size):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = PeriodicAverager(1, module=model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert averager.flat.is_bound() and len(averager.flat.buffers) == 1
    model(torch.randn(8, 4) + rank).sum().backward()
    opt.step()
    ptrs = [b.data_ptr() for b in averager.flat.buffers]
    averager.maybe_average()
    assert [b.data_ptr() for b in averager.flat.buffers] == ptrs  # in place, nothing reallocated
    assert averager.flat.is_bound()
    bn = model[1]
    return {
        "running_mean": bn.running_mean.clone(),
        "tracked": int(bn.num_batches_tracked),
        "numel": averager.flat.numel,
    }


@pytest.mark.timeout(60)
def test_parameters_and_float_buffers_become_views_averaged_in_place():
    results = run_distributed(_views_worker, 2)
    assert torch.equal(results[0]["running_mean"], results[1]["running_mean"])
    assert results[0]["numel"] == 4 * 4 + 4 + 4 + 4 + 4 + 4  # weights, biases, BN affine + stats
    assert results[0]["tracked"] == 1


def _state_worker(rank, world_size):
    model = _model()
    a = PeriodicAverager(4, 3, module=model)
    for _ in range(6):
        a.maybe_average()
    b = PeriodicAverager(4, 3, module=copy.deepcopy(model))
    b.load_state_dict(a.state_dict())
    same = [a.maybe_average() for _ in range(5)] == [b.maybe_average() for _ in range(5)]
    return same, dist.get_world_size()


@pytest.mark.timeout(60)
def test_state_dict_keeps_the_step():
    assert run_distributed(_state_worker, 2) == [(True, 2), (True, 2)]


def test_rejects_bad_period_and_warmup():
    with pytest.raises(ValueError, match="period"):
        PeriodicAverager(0, module=_model())
    with pytest.raises(ValueError, match="warmup_steps"):
        PeriodicAverager(2, -1, module=_model())

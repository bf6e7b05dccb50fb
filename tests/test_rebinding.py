"""Never a silent no-op: a tensor rebound away from the flat buffer is put back and averaged.

Each case rebinds the parameters the way a user or a torch API does, then averages: the result
must be the mean of the values the parameters hold *now* (torch's semantics), and the tensors
must live in the averager's buffers again.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from localsgd.averaging import (
    HierarchicalAverager,
    OuterAverager,
    PeriodicAverager,
    averaged_tensors,
)
from tests.helpers import run_distributed

pytestmark = pytest.mark.slow


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _rank_values(model: torch.nn.Module, rank: int, dtype=torch.float32) -> dict:
    return {
        name: torch.full_like(t, rank + 1.0, dtype=dtype) * (i + 1)
        for i, (name, t) in enumerate(model.state_dict().items())
        if torch.is_floating_point(t)
    }


def _rebind(case: str, model: torch.nn.Module, rank: int) -> None:
    if case == "data_assign":
        for p in model.parameters():
            p.data = torch.full_like(p, rank + 1.0)
    elif case in ("to_dtype", "double"):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(rank + 1.0)
        if case == "double":
            model.double()
        else:
            model.to(torch.float64)
    elif case == "vector_to_parameters":
        vec = torch.arange(parameters_to_vector(model.parameters()).numel(), dtype=torch.float32)
        vector_to_parameters(vec * (rank + 1), model.parameters())
    elif case == "load_state_dict_assign":
        state = model.state_dict()
        state.update(_rank_values(model, rank))
        model.load_state_dict(state, assign=True)
    else:
        raise AssertionError(case)


def _rebind_worker(rank, world_size, case, comm_dtype):
    model = _model()
    averager = PeriodicAverager(1, module=model, comm_dtype=comm_dtype)
    averager.broadcast_(0)
    _rebind(case, model, rank)
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_floating_point(v)}
    held = averager.flat.tensors
    was_bound = averager.flat.is_bound() and all(
        a is b for a, b in zip(averaged_tensors(model), held, strict=False)
    )
    averaged = averager.maybe_average()
    expected = {}
    for k, v in before.items():
        total = v.clone()
        dist.all_reduce(total)
        expected[k] = total / world_size
    after = {k: v.clone() for k, v in model.state_dict().items() if torch.is_floating_point(v)}
    return {
        "was_bound": was_bound,
        "averaged": averaged,
        "bound": averager.flat.is_bound(),
        "dtypes": {str(p.dtype) for p in model.parameters()},
        "max_error": max(
            float((after[k] - expected[k]).abs().max() / expected[k].abs().max().clamp(min=1))
            for k in before
        ),
        "changed": any(not torch.equal(after[k], before[k]) for k in before),
    }


CASES = ["data_assign", "to_dtype", "double", "vector_to_parameters", "load_state_dict_assign"]
DTYPES = ["float32", "bfloat16"]


def _all_cases_worker(rank, world_size):
    return {
        (case, dtype): _rebind_worker(rank, world_size, case, dtype)
        for case in CASES
        for dtype in DTYPES
    }


@pytest.fixture(scope="module")
def rebound():
    return run_distributed(_all_cases_worker, 2)  # one pair of processes for every case


@pytest.mark.parametrize("comm_dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_rebound_tensors_are_averaged_as_they_are_now(rebound, case, comm_dtype):
    results = [per_rank[case, comm_dtype] for per_rank in rebound]
    tolerance = 1e-6 if comm_dtype == "float32" else 1e-2  # relative; bf16 keeps ~3 digits
    for r in results:
        assert not r["was_bound"], "the case did not rebind anything: the test would prove nothing"
        assert r["averaged"] and r["bound"] and r["changed"]
        assert r["max_error"] <= tolerance, r
    if case in ("to_dtype", "double"):
        assert all(r["dtypes"] == {"torch.float64"} for r in results)  # the user's dtype is kept


def _contract_worker(rank, world_size):
    model, other = _model(), _model()
    averager = PeriodicAverager(2, warmup_steps=1)  # torch's signature: no module
    out = {"is_model_averager": isinstance(averager, ModelAverager)}
    try:
        averager.maybe_average()
    except ValueError as e:
        out["unbound"] = str(e)
    averager.average_parameters(model.parameters())
    out["step_type"] = type(averager.step).__name__
    out["step"] = averager.step
    try:
        averager.average_parameters(other.parameters())
    except ValueError as e:
        out["foreign"] = str(e)
    try:
        averager.average_parameters(list(model.parameters())[:1])
    except ValueError as e:
        out["subset"] = str(e)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(rank)  # no .grad anywhere: torch's averager would skip every one
    averager.step = 7  # torch's PostLocalSGDOptimizer.load_state_dict sets it so
    out["after_set"] = averager.maybe_average()  # (7 - 1) % 2 == 0: averages, as torch would
    out["grad_none_averaged"] = all(
        torch.equal(p, torch.full_like(p, (world_size - 1) / 2)) for p in model.parameters()
    )
    hier = HierarchicalAverager({2: 2, 4: world_size}, module=_model())
    out["hier_is_model_averager"] = isinstance(hier, ModelAverager)
    outer = OuterAverager(2, module=_model())
    out["outer_is_model_averager"] = isinstance(outer, ModelAverager)
    return out


def test_averager_contract_matches_torch_and_refuses_foreign_parameters():
    results = run_distributed(_contract_worker, 2)
    for r in results:
        assert r["is_model_averager"] and r["hier_is_model_averager"]
        assert r["outer_is_model_averager"]
        assert r["step_type"] == "int" and r["step"] == 1
        assert "holds no parameters yet" in r["unbound"]
        assert "1 not held" not in r["foreign"] and "not held" in r["foreign"]
        assert "\n" not in r["foreign"] and "build a new averager" in r["foreign"]
        assert "not held" in r["subset"]
        assert r["after_set"] is True
        assert r["grad_none_averaged"]

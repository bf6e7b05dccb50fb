"""The NaN/Inf guard's one pass (localsgd/averaging/finite.py): where gloo averages, a guarded
mean over a power-of-two group divides in the pass that checks and sums, with gloo's AVG bits;
a poisoned round's result is the one the separate check gives; other sizes, dtypes and builds
without the fused kernel keep the check and AVG. Real gloo groups, one per thread of this
process (no process starts)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import finite
from localsgd.averaging.comm import Communicator
from localsgd.averaging.virtual import thread_worlds

pytestmark = pytest.mark.timeout(60)

TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number


def _in_gloo(fn, size: int) -> list:
    """`fn(rank)` in `size` threads, each rank of one real gloo group; what each returned."""
    store, out, errors = dist.HashStore(), [None] * size, []

    def body(rank: int) -> None:
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=30))  # fmt: skip
            try:
                out[rank] = fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001  (raised below, in the test's thread)
            errors.append(e)

    with thread_worlds():
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(45)
    if errors:
        raise errors[0]
    assert all(not t.is_alive() for t in threads), "a gloo thread hung"
    return out


def _values(rank: int, n: int = 100_003) -> torch.Tensor:
    """Magnitudes over many orders, all far from float32's edges."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """Counts the guard's separate summing passes (`all_finite` calls)."""
    calls: list[int] = []
    real = finite.all_finite

    def counted(tensors):
        calls.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(finite, "all_finite", counted)
    return calls


def _means(rank: int, through: torch.dtype | None = None) -> dict:
    """A guarded and an unguarded mean of this rank's values, blocking and launched."""
    x = _values(rank)
    wire = None if through is None else torch.empty(x.numel(), dtype=through)
    out = {}
    for name, guard in (("guarded", True), ("unguarded", False)):
        comm = Communicator(guard=guard)
        out[name] = x.clone()
        comm.mean_(out[name], through=wire)
        pieces = list(x.clone().split([40_000, 60_003]))
        wires = None if wire is None else list(wire.clone().split([40_000, 60_003]))
        comm.launch_mean_(pieces, through=wires).wait()
        out[name + "-launched"] = torch.cat(pieces)
        comm.weigh(float(rank + 1))  # a weighted round: each share multiplied in, summed
        out[name + "-weighted"] = x.clone()
        comm.mean_(out[name + "-weighted"], through=wire)
        comm.unweigh()
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_a_guarded_mean_checks_in_the_division_with_gloos_avg_bits(size, checks):
    """At 2 and 4 workers the guarded mean makes no separate check (it divides in the fused
    pass and sums), and gives the unguarded mean's bits (gloo's AVG) on every rank; so does
    a weighted round (its share multiplied in the fused pass)."""
    got = _in_gloo(_means, size)
    assert checks == []
    for g in got:  # (the launched pieces are other ring chunks: other bits from 3 workers on)
        assert torch.equal(g["guarded"], got[0]["unguarded"])
        assert torch.equal(g["guarded-launched"], got[0]["unguarded-launched"])
        assert torch.equal(g["guarded-weighted"], got[0]["unguarded-weighted"])


def test_other_sizes_dtypes_and_builds_keep_the_check_and_avg(checks, monkeypatch):
    """3 workers (a division by 3 first would not give AVG's bits), a bfloat16 wire, and a
    torch without the fused kernel: the separate check, then gloo's AVG; the same bits as
    the unguarded mean."""
    # the separate checks per rank: the plain and launched means (float32 weighted rounds
    # multiply in the fused pass at any size), or all three means
    for size, through, per_rank in ((3, None, 2), (2, torch.bfloat16, 3)):
        checks.clear()
        got = _in_gloo(lambda r, t=through: _means(r, t), size)
        assert len(checks) == per_rank * size, (size, through)
        for g in got:
            assert torch.equal(g["guarded"], got[0]["unguarded"]), (size, through)
            assert torch.equal(g["guarded-launched"], got[0]["unguarded-launched"])
    monkeypatch.setattr(finite, "_CHECK_AND_SCALE", None)
    checks.clear()
    got = _in_gloo(_means, 4)
    assert len(checks) == 3 * 4
    assert all(torch.equal(g["guarded"], got[0]["unguarded"]) for g in got)


def test_dividing_by_three_first_does_not_give_avg_bits():
    """Why 3 workers keep AVG: dividing first rounds differently from gloo's sum-then-divide."""

    def both(rank: int) -> bool:
        x = _values(rank)
        avg, divided = x.clone(), x.clone().div_(3)
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        dist.all_reduce(divided)
        return torch.equal(avg, divided)

    assert not any(_in_gloo(both, 3))


def _poisoned(rank: int, weighted: bool) -> dict:
    comm = Communicator()
    x = _values(rank, 1001)
    if rank == 1:
        x[7] = float("nan")
    if weighted:
        comm.weigh(float(rank + 1))
    comm.mean_(x)
    return {"mean": x, "dropped": list(comm.dropped)}


@pytest.mark.parametrize("size", [2, 4])
def test_a_nan_contribution_is_dropped_with_the_separate_checks_bits(size, checks, monkeypatch):
    """Rank 1 sends a NaN: every rank ends with the mean of the others (weighted too), named
    rank 1 as dropped, and the same bits as the guard with a separate check (the fused
    kernel absent) gave."""
    for weighted in (False, True):
        checks.clear()
        fused = _in_gloo(lambda r, w=weighted: _poisoned(r, w), size)
        assert checks == []
        kept = [r for r in range(size) if r != 1]
        w = torch.tensor([float(r + 1) if weighted else 1.0 for r in kept])
        expected = (w[:, None] * torch.stack([_values(r, 1001) for r in kept])).sum(0) / w.sum()
        for g in fused:
            assert g["dropped"] == [1]
            assert torch.equal(g["mean"], fused[0]["mean"])
            assert torch.allclose(g["mean"], expected, rtol=1e-5, atol=1e-6)
        kernel = finite._CHECK_AND_SCALE
        monkeypatch.setattr(finite, "_CHECK_AND_SCALE", None)
        separate = _in_gloo(lambda r, w=weighted: _poisoned(r, w), size)
        monkeypatch.setattr(finite, "_CHECK_AND_SCALE", kernel)
        assert len(checks) == size  # the separate check ran
        for g in separate:
            assert g["dropped"] == [1]
            assert torch.equal(g["mean"], fused[0]["mean"]), weighted


def test_where_dividing_first_differs_from_avg():
    """The module doc's edges, at 2 and 4 workers: the bits differ only where a contribution,
    the sum or the mean is below size x float32's smallest normal in magnitude (by at most
    1.5e-42), or where the sum overflows (AVG: Inf; dividing first: the finite mean)."""

    def both(rank: int) -> dict:
        g = torch.Generator().manual_seed(50 + rank)
        n = 200_003
        m = torch.randn(n, generator=g, dtype=torch.float64)
        x = (m * torch.pow(2.0, torch.randint(-150, 126, (n,), generator=g))).float()
        x[:2] = torch.tensor([3e38, -3e38])  # on every rank: the sum overflows, the mean not
        guarded, avg = x.clone(), x.clone()
        Communicator(guard=True).mean_(guarded)
        Communicator(guard=False).mean_(avg)
        everyone = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, x)
        return {"guarded": guarded, "avg": avg, "x": torch.stack(everyone).double()}

    for size in (2, 4):
        got = _in_gloo(both, size)[0]
        guarded, avg, x = got["guarded"], got["avg"], got["x"]
        assert torch.equal(guarded[:2], x[0, :2].float())
        assert avg[:2].tolist() == [float("inf"), float("-inf")]
        differ = guarded != avg
        edge = ((x.abs() < TINY * size) & (x != 0)).any(0) | (avg.abs() < TINY * size)
        edge |= x.sum(0).abs() > torch.finfo(torch.float32).max
        assert differ.any() and not (differ & ~edge).any(), size
        finite_both = differ & torch.isfinite(avg)
        assert (guarded[finite_both].double() - avg[finite_both].double()).abs().max() <= 1.5e-42

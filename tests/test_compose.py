"""Combinations the old core refused, now made of the round's stages, checked against the
combinations they are built from (issue 47). One spawn of 4 gloo processes runs every case:

- a delayed round over a lossy wire (int4 with error feedback, top-k) or a robust combine
  (median) merges what the blocking round of the same inputs gives, to the bit;
- plain Streaming DiLoCo over a 4-bit wire, one fragment, equals the plain periodic round over
  that wire, to the bit;
- a robust round with its outer state in host memory equals the one on the device, to the bit;
- weighted rounds over hierarchical levels weigh each level by its own counts (the weighted
  mean of each group, to 1e-6), and equal counts leave the unweighted bits;
- weighted eager rounds weigh by samples (equal counts: the unweighted bits; unequal: another
  model, the same on every rank where every rank must agree).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from localsgd.averaging import HierarchicalAverager, OuterAverager, PeriodicAverager
from localsgd.averaging.streaming.averager import StreamingAverager
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.wire.sparse import TopKCodec
from tests.helpers import run_distributed

pytestmark = pytest.mark.timeout(120)

WORLD = 4


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _step(model, gen, scale: float = 0.01) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _delayed_against_blocking(rank: int, make) -> tuple[torch.Tensor, torch.Tensor]:
    """The same local steps on two copies at period 2, one averaged blocking after steps 0 and
    2, the other launched after them and merged after steps 1 and 3, which train nothing (the
    merge keeps no progress). Returns both models' parameters after their syncs."""
    out = []
    for overlap in (False, True):
        model = _Net()
        avg = make(model, overlap)
        gen = torch.Generator().manual_seed(10 + rank)
        for step in range(4):
            if step in (0, 2):
                _step(model, gen)
            avg.maybe_average()
        out.append(_params(model))
    return out[0], out[1]


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    got: dict = {}
    # 1. delayed rounds over lossy wires and a robust combine: the blocking round's bits
    wires = {
        "int4": dict(comm_dtype="int4", error_feedback=True),
        "topk": dict(comm_dtype=TopKCodec(density=0.25), error_feedback=True),
        "median": dict(aggregate=Aggregate("median")),
    }
    for name, kw in wires.items():
        blocking, delayed = _delayed_against_blocking(
            rank, lambda m, overlap, kw=kw: PeriodicAverager(2, module=m, overlap=overlap, **kw)
        )
        got[f"delayed_{name}"] = (blocking, delayed)
    # 2. plain streaming over a 4-bit wire, one fragment = the periodic round over that wire
    runs = []
    for make in (
        lambda m: PeriodicAverager(2, module=m, comm_dtype="int4", error_feedback=True),
        lambda m: StreamingAverager(
            2, module=m, outer=False, comm_dtype="int4", error_feedback=True
        ),  # fmt: skip
    ):
        model = _Net()
        avg, gen = make(model), torch.Generator().manual_seed(20 + rank)
        for _ in range(6):
            _step(model, gen)
            avg.maybe_average()
        runs.append(_params(model))
    got["streaming_plain_int4"] = runs
    # 3. a robust round with its outer state in host memory = on the device
    runs = []
    for state in ("device", "cpu"):
        model = _Net()
        avg = OuterAverager(2, module=model, aggregate=Aggregate("median"), outer_state=state)
        gen = torch.Generator().manual_seed(30 + rank)
        for _ in range(6):
            _step(model, gen)
            avg.maybe_average()
        runs.append((_params(model), avg.rounds.host))
    got["median_outer_state_cpu"] = runs
    # 4. weighted hierarchical levels: everyone after step 0, groups of 2 after step 1
    samples = [1.0, 3.0, 2.0, 6.0]
    for counts in ("equal", "unequal"):
        runs = []
        for weighted in (False, True):
            model = _Net()
            avg = HierarchicalAverager({1: 2, 2: 4}, module=model)
            avg.weighted = weighted
            gen = torch.Generator().manual_seed(40 + rank)
            seen = []
            for _ in range(2):
                _step(model, gen)
                before = _params(model)
                avg.trained(samples[rank] if counts == "unequal" else 1.0)
                avg.maybe_average()
                seen.append((before, _params(model)))
            runs.append(seen)
        got[f"levels_{counts}"] = runs
    # 5. weighted eager rounds
    for counts in ("equal", "unequal"):
        runs = []
        for weighted in (False, True):
            model = _Net()
            avg = StreamingAverager(2, module=model, eager=True)
            avg.weighted = weighted
            gen = torch.Generator().manual_seed(50 + rank)
            received = []
            for _ in range(8):
                _step(model, gen)
                avg.trained(samples[rank] if counts == "unequal" else 1.0)
                avg.maybe_average()
                if avg.merged:  # what every rank received in this round
                    received.append([t.clone() for t in avg.common_tensors()])
            runs.append((_params(model), received))
        got[f"eager_{counts}"] = runs
    return got


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout_s=100)


@pytest.mark.parametrize("wire", ["int4", "topk", "median"])
def test_a_delayed_round_merges_what_the_blocking_round_gives(results, wire):
    for r in results:
        blocking, delayed = r[f"delayed_{wire}"]
        assert torch.equal(blocking, delayed)
    # and the round did something: the replicas moved together from their own changes
    assert torch.equal(results[0][f"delayed_{wire}"][0], results[3][f"delayed_{wire}"][0])


def test_plain_streaming_over_a_4_bit_wire_is_the_periodic_round_over_it(results):
    for r in results:
        periodic, streaming = r["streaming_plain_int4"]
        assert torch.equal(periodic, streaming)


def test_a_robust_round_with_host_outer_state_equals_the_device_one(results):
    for r in results:
        (device, on_host_there), (host, on_host) = r["median_outer_state_cpu"]
        assert torch.equal(device, host)
        assert on_host and not on_host_there  # the state really moved to the host staging


def test_weighted_levels_weigh_each_group_by_its_own_counts(results):
    samples = [1.0, 3.0, 2.0, 6.0]
    for r in results:  # equal counts: the unweighted bits
        plain, weighted = r["levels_equal"]
        assert all(torch.equal(a[1], b[1]) for a, b in zip(plain, weighted, strict=True))
    # the widest level after step 0, then groups of 2 after step 1, each weighted by the
    # samples trained since the level's values last started from a global one
    for step, groups in ((0, ((0, 1, 2, 3),)), (1, ((0, 1), (2, 3)))):
        befores = [r["levels_unequal"][1][step][0] for r in results]
        for group in groups:
            total = sum(samples[i] for i in group)
            want = sum(befores[i] * (samples[i] / total) for i in group)
            for i in group:
                plain, weighted = results[i]["levels_unequal"]
                torch.testing.assert_close(weighted[step][1], want, rtol=0, atol=1e-6)
                assert not torch.allclose(plain[step][1], weighted[step][1], rtol=0, atol=1e-6)


def test_weighted_eager_rounds_weigh_by_samples(results):
    for r in results:  # equal counts: the unweighted bits
        (plain, _), (weighted, _) = r["eager_equal"]
        assert torch.equal(plain, weighted)
    for r in results:
        (plain, _), (weighted, _) = r["eager_unequal"]
        assert not torch.equal(plain, weighted)
    # what every rank received at each eager round is the same on every rank
    received = [r["eager_unequal"][1][1] for r in results]
    assert len(received[0]) == 3  # 4 rounds; the first receives nothing yet
    for other in received[1:]:
        for mine, theirs in zip(received[0], other, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))

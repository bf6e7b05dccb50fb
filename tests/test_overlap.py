"""sync.overlap: the average launched asynchronously at a sync and merged one step later; it is
Streaming DiLoCo's delayed merge at P=1, τ=1 with merge_rule=progress, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import PeriodicAverager, StreamingAverager
from tests.helpers import CollectiveCounter, run_distributed

pytestmark = pytest.mark.slow

BUCKET_MB = 64 / 2**20  # 64-byte buckets: the model's 83 floats go out in several all-reduces


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _local_step(model, opt, gen) -> None:
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _delayed_worker(rank, world_size, period, warmup, steps):
    """Ours with overlap next to the definition, written out with a blocking all-reduce."""
    ours_model, ref_model = _model(), _model()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ours = PeriodicAverager(period, warmup, module=ours_model, overlap=True, bucket_mb=BUCKET_MB)
    gen_ours = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    gen_ref = torch.Generator().manual_seed(100 + rank)
    pending = None  # the reference's (state at the sync, its average)
    launched, merged, collectives, max_gap, received = [], [], [], 0.0, []
    for s in range(steps):
        _local_step(ours_model, ours_opt, gen_ours)
        with CollectiveCounter() as counter:
            launched.append(ours.maybe_average())
        collectives.append(counter.count)
        merged.append(ours.merged)
        if ours.merged:
            received.append(torch.cat([a.clone() for a in ours.rounds.averages]))

        _local_step(ref_model, ref_opt, gen_ref)
        with torch.no_grad():
            if pending is not None:  # x <- mean(x_s) + (x_{s+1} - x_s)
                origin, average = pending
                for p, o, a in zip(ref_model.parameters(), origin, average, strict=True):
                    p.sub_(o).add_(a)
                pending = None
            if s >= warmup and (s - warmup) % period == 0:
                origin = [p.detach().clone() for p in ref_model.parameters()]
                average = [o.div(world_size) for o in origin]
                for a in average:
                    dist.all_reduce(a)
                pending = (origin, average)
        max_gap = max(max_gap, (_flat(ours_model) - _flat(ref_model)).abs().max().item())
    before_final = _flat(ours_model)
    ours.average()  # blocking: merges the one in flight, then averages
    return {
        "launched": launched,
        "merged": merged,
        "collectives": collectives,
        "max_gap": max_gap,
        "received": received,
        "before_final": before_final,
        "final": _flat(ours_model),
        "rounds": ours.stats.rounds,
        "buckets": len(range(0, ours.flat.numel, max(1, int(BUCKET_MB * 2**20) // 4))),
    }


@pytest.mark.timeout(120)
def test_overlap_merges_the_average_one_step_late_and_keeps_local_progress():
    period, warmup, steps = 3, 2, 12
    results = run_distributed(_delayed_worker, 2, period, warmup, steps)
    syncs = [s for s in range(steps) if s >= warmup and (s - warmup) % period == 0]
    for r in results:
        assert [s for s, x in enumerate(r["launched"]) if x] == syncs  # torch's step rule
        merges = [s + 1 for s in syncs if s + 1 < steps]
        assert [s for s, x in enumerate(r["merged"]) if x] == merges
        # all-reduces only at a launch, one per bucket; none while the average is in flight
        expected = [r["buckets"] if s in syncs else 0 for s in range(steps)]
        assert r["collectives"] == expected and r["buckets"] > 1
        assert r["max_gap"] == 0.0, "differs from x <- mean(x_s) + (x_{s+1} - x_s)"
        assert r["rounds"] == len(syncs) + 1
    # what every rank receives is bit-identical; the replicas differ by their own last step
    for a, b in zip(results[0]["received"], results[1]["received"], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(results[0]["before_final"], results[1]["before_final"])
    assert torch.equal(results[0]["final"], results[1]["final"])


def _resume_worker(rank, world_size):
    """A state_dict taken with an average in flight resumes to exactly the same trajectory."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = PeriodicAverager(2, module=model, overlap=True, bucket_mb=BUCKET_MB)
    gen = torch.Generator().manual_seed(7 + rank)
    for _ in range(3):  # launches after steps 0 and 2; the second is in flight
        _local_step(model, opt, gen)
        averager.maybe_average()
    assert averager.rounds.pending
    state = averager.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_gen = gen.get_state()

    twin = _model()
    twin.load_state_dict(saved_model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin_avg = PeriodicAverager(2, module=twin, overlap=True, bucket_mb=BUCKET_MB)
    twin_avg.load_state_dict(state)
    twin_gen = torch.Generator().manual_seed(0)
    twin_gen.set_state(saved_gen)
    for _ in range(4):
        _local_step(model, opt, gen)
        averager.maybe_average()
        _local_step(twin, twin_opt, twin_gen)
        twin_avg.maybe_average()
    return torch.equal(_flat(model), _flat(twin)), averager.step


@pytest.mark.timeout(60)
def test_overlap_state_dict_with_an_average_in_flight_resumes_exactly():
    for same, step in run_distributed(_resume_worker, 2):
        assert same and step == 7


def test_overlap_refuses_what_it_does_not_support():
    # refused before anything collective: no process group needed
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        PeriodicAverager(2, module=_model(), overlap=True, bucket_mb=0)


def _general_worker(rank, world_size, steps):
    """PeriodicAverager(overlap=True) (its rule: a round launched after each sync step, merged
    with the progress rule one step later) next to the general mechanism it is a case of:
    StreamingAverager with τ=1, merge_rule=progress, plain averaging, the same buckets."""
    out = {}
    for period, warmup in ((3, 2), (1, 0)):  # period 1: each step merges, then launches again
        models = [_model(), _model()]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        old = PeriodicAverager(period, warmup, module=models[0], overlap=True, bucket_mb=BUCKET_MB)
        new = StreamingAverager(
            period, warmup, module=models[1], delay_steps=1, merge_rule="progress", outer=False,
            bucket_mb=BUCKET_MB, init_sync=False,
        )  # fmt: skip
        gens = [torch.Generator().manual_seed(3 + rank) for _ in models]
        same, calls, received = [], [], []
        for _ in range(steps):
            counts = []
            for m, o, g, avg in zip(models, opts, gens, (old, new), strict=True):
                _local_step(m, o, g)
                with CollectiveCounter() as counter:
                    avg.maybe_average()
                counts.append(counter.count)
            calls.append(counts[0] == counts[1])
            same.append(torch.equal(_flat(models[0]), _flat(models[1])))
            assert old.merged == new.merged and old.all_in_sync == new.all_in_sync
            if new.merged:
                ours = torch.cat([t.reshape(-1) for t in new.common_tensors()])
                theirs = torch.cat([t.reshape(-1) for t in old.common_tensors()])
                # (at period 1 PeriodicAverager's common_tensors() reads its launched wire
                # buffer, `rounds.sent`, which already holds the next launch's values)
                assert period == 1 or torch.equal(ours, theirs)
                received.append(ours)
        old.average()
        new.average()
        same.append(torch.equal(_flat(models[0]), _flat(models[1])))
        counters = [(a.stats.rounds, a.stats.bytes, a.comm_levels()) for a in (old, new)]
        out[period] = (same, calls, counters[0] == counters[1], received)
    return out


@pytest.mark.timeout(60)
def test_overlap_is_the_delayed_progress_merge_of_the_general_mechanism_bit_for_bit():
    results = run_distributed(_general_worker, 2, 10)
    for period in (3, 1):
        for r in results:
            same, calls, counters, _ = r[period]
            assert all(same), (period, same.index(False))
            assert all(calls) and counters, period  # the same buckets, rounds and bytes
        a, b = results[0][period][3], results[1][period][3]
        assert a and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # the mean received

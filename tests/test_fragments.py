"""Streaming DiLoCo: fragments, delayed merges with mixing, eager outer steps
(averaging/streaming/averager.py)."""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging import CommStats, OuterAverager, PeriodicAverager, SimulatedLink
from localsgd.averaging.comm import supports_avg
from localsgd.averaging.streaming.averager import StreamingAverager
from localsgd.averaging.streaming.fragments import fragment_ids, model_blocks
from localsgd.config import SyncConfig, SyncLevel
from localsgd.loop.strategies import build_averager
from tests.helpers import run_distributed


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """A stem, four repeated blocks (a ModuleList), a head; `bn` adds BatchNorm to the stem."""

    def __init__(self, bn: bool = False, blocks: int = 4):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.blocks = nn.ModuleList(Block(8) for _ in range(blocks))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.norm(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net(bn: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(bn)


def _step(model, opt, gen) -> None:
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _state(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _launch_fragment(s: int, warmup: int, period: int, fragments: int) -> int | None:
    """The documented schedule, written out: fragment p launches after step s when
    s >= warmup and (s - warmup) % period == p * period / fragments."""
    for p in range(fragments):
        if s >= warmup and (s - warmup - p * period // fragments) % period == 0:
            return p
    return None


# --- (4) the split, in one process ------------------------------------------------------------


def test_blocks_and_the_strided_split():
    net = _net()
    assert model_blocks(net) == list(net.blocks)
    names = [n for n, _ in net.named_parameters()]
    ids = dict(zip(names, fragment_ids(net, 2), strict=True))
    # blocks 0, 2 -> fragment 0; blocks 1, 3 -> fragment 1; outside tensors to the smaller one
    assert {n for n, f in ids.items() if f == 0} == {
        "stem.weight",
        *(f"blocks.{b}.lin.{w}" for b in (0, 2) for w in ("weight", "bias")),
    }
    assert fragment_ids(net, 1) == [0] * len(names)
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    assert model_blocks(seq) == [seq[0], seq[2]]  # children without tensors are not blocks


def test_a_model_with_too_few_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^fragments=5 needs at least 5 blocks, the model has 4$"):
        StreamingAverager(10, module=_net(), fragments=5)
    with pytest.raises(ValueError, match="multiple of fragments"):
        StreamingAverager(10, module=_net(), fragments=4)
    with pytest.raises(ValueError, match="delay_steps"):
        StreamingAverager(8, module=_net(), fragments=4, delay_steps=3)
    with pytest.raises(ValueError, match="progress' needs delay_steps >= 1"):
        StreamingAverager(8, module=_net(), fragments=2, merge_rule="progress")


# --- (1) P=1 is today's DiLoCo / plain averaging, bit for bit ----------------------------------


def _p1_worker(rank, world_size, steps):
    torch.set_num_threads(1)
    out = {}
    for name, warmup in (("outer", 3), ("outer", 0), ("plain", 2)):
        models = [_net(bn=True), _net(bn=True)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        if name == "outer":
            ref = OuterAverager(4, warmup, module=models[0])
        else:
            ref = PeriodicAverager(4, warmup, module=models[0])
        ours = StreamingAverager(4, warmup, module=models[1], outer=name == "outer")
        gens = [torch.Generator().manual_seed(10 + rank) for _ in models]
        equal = []
        for _ in range(steps):
            for m, o, g in zip(models, opts, gens, strict=True):
                _step(m, o, g)
            ref.maybe_average()
            ours.maybe_average()
            equal.append(_same(_state(models[0]), _state(models[1])))
            assert ref.all_in_sync == ours.all_in_sync
        ref.average()
        ours.average()
        equal.append(_same(_state(models[0]), _state(models[1])))
        out[(name, warmup)] = (equal, ours.stats.bytes == ref.stats.bytes)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_fragment_is_diloco_and_plain_averaging_bit_for_bit():
    for result in run_distributed(_p1_worker, 2, 30):
        for key, (equal, same_bytes) in result.items():
            assert all(equal), (key, equal.index(False))
            assert same_bytes, key


# --- (2) + (6) bytes per sync and the schedule; the simulated link is hidden --------------------


def _bytes_worker(rank, world_size, steps, warmup, period, fragments, delay):
    torch.set_num_threads(1)
    model = _net(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = StreamingAverager(
        period, warmup, module=model, fragments=fragments, delay_steps=delay, merge_alpha=0.5
    )
    frag_bytes = [sum(e - s for _, s, _, e in rs) * 4 for rs in avg.rounds.parts]
    gen = torch.Generator().manual_seed(rank)
    sent, merged = [], []
    for _ in range(steps):
        _step(model, opt, gen)
        before = avg.stats.bytes
        avg.maybe_average()
        sent.append(avg.stats.bytes - before)
        merged.append(avg.last_part)
    return {
        "frag_bytes": frag_bytes,
        "total": avg.flat.nbytes,
        "sent": sent,
        "merged": merged,
        "levels": avg.comm_levels(),
    }


def _link_worker(rank, world_size):
    torch.set_num_threads(1)
    link = SimulatedLink(latency_ms=300)
    times = {}
    for delay in (0, 2):
        model = _net()
        avg = StreamingAverager(8, module=model, fragments=2, delay_steps=delay, link=link)
        calls = []
        for _ in range(4):  # launch after step 0, merge after step `delay`
            start = time.perf_counter()
            avg.maybe_average()
            calls.append(time.perf_counter() - start)
            time.sleep(0.2)  # a training step
        times[delay] = calls
    return times


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_sync_sends_its_fragment_at_the_documented_steps():
    steps, warmup, period, fragments, delay = 30, 3, 8, 4, 1
    results = run_distributed(_bytes_worker, 2, steps, warmup, period, fragments, delay)
    r = results[0]
    assert sum(r["frag_bytes"]) == r["total"] and min(r["frag_bytes"]) > 0
    for s in range(steps):
        p = _launch_fragment(s, warmup, period, fragments)
        assert r["sent"][s] == (0 if p is None else r["frag_bytes"][p]), s
        q = _launch_fragment(s - delay, warmup, period, fragments)
        assert r["merged"][s] == q, s
    assert r["levels"][0]["bytes"] == sum(r["sent"])
    assert r["levels"][0]["rounds"] == sum(1 for b in r["sent"] if b)
    assert results[1]["sent"] == r["sent"]
    timings = run_distributed(_link_worker, 2)[0]
    assert timings[0][0] >= 0.29  # blocking: the link's time at the sync
    assert max(timings[2]) < 0.2, timings[2]  # launched after step 0, merged after step 2


# --- (3) τ=2, α=0.5 against a blocking reference ----------------------------------------------


def _mean(t: torch.Tensor, size: int, group=None) -> None:
    """A blocking mean over `group`, as every averager here takes it."""
    if supports_avg(group):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    else:
        dist.all_reduce(t.div_(size), group=group)


def _reference_worker(
    rank, world_size, steps, warmup, period, delay, alpha, eager=False, inner=None, rule="mix"
):
    """`inner=(period, group_size)`: one inner level, written out as documented: after step s
    (s >= warmup, its period dividing s) the whole model is averaged within contiguous groups,
    before the merge and the launch of that step. `rule="progress"`: a merge gives the new
    anchor plus this rank's progress since the launch."""
    torch.set_num_threads(1)
    fragments = 2
    ours_model, ref_model = _net(), _net()
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
    ours = StreamingAverager(
        period, warmup, module=ours_model, fragments=fragments, delay_steps=delay,
        merge_alpha=alpha, eager=eager, inner_levels=dict([inner]) if inner else None,
        merge_rule=rule,
    )  # fmt: skip
    group = None
    if inner:
        size = inner[1]
        chunks = [list(range(i, i + size)) for i in range(0, world_size, size)]
        group, _ = dist.new_subgroups_by_enumeration(chunks)
    ids = fragment_ids(ref_model, fragments)
    params = list(ref_model.parameters())
    members = [[t for t, f in zip(params, ids, strict=True) if f == p] for p in range(fragments)]

    def flat(p):
        return torch.cat([t.detach().reshape(-1) for t in members[p]])

    anchors = [flat(p) for p in range(fragments)]
    outer = [torch.optim.SGD([a], lr=0.7, momentum=0.9, nesterov=True) for a in anchors]
    gens = [torch.Generator().manual_seed(5 + rank) for _ in range(2)]
    pending, equal, common = None, [], []
    delayed = [(torch.zeros_like(a), torch.zeros_like(a)) for a in anchors]
    for s in range(steps):
        _step(ours_model, ours_opt, gens[0])
        ours.maybe_average()
        _step(ref_model, ref_opt, gens[1])
        with torch.no_grad():
            if inner and s >= warmup and s % inner[0] == 0:
                for t in params:
                    _mean(t.data, inner[1], group)
            if pending is not None and s == pending[2] + delay:
                p, mean, _, plain, origin = pending
                if plain:
                    anchors[p].sub_(mean)
                else:
                    anchors[p].grad = mean
                    outer[p].step()
                if rule == "progress":
                    merged = flat(p).sub_(origin).add_(anchors[p])
                else:
                    merged = flat(p).mul_(alpha).add_(anchors[p], alpha=1 - alpha)
                torch.nn.utils.vector_to_parameters(merged, members[p])
                pending = None
            p = _launch_fragment(s, warmup, period, fragments)
            if eager and p is not None:  # Kale et al.: d/M + D_prev - d_prev/M, D one round late
                d = anchors[p] - flat(p)
                mean = d.clone()
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
                own, late = delayed[p]
                anchors[p].grad = own.div(-world_size).add_(late).add_(d, alpha=1 / world_size)
                outer[p].step()
                merged = flat(p).mul_(alpha).add_(anchors[p], alpha=1 - alpha)
                torch.nn.utils.vector_to_parameters(merged, members[p])
                delayed[p] = (d, mean)
            elif p is not None:
                g = anchors[p] - flat(p)
                _mean(g, world_size)
                plain = warmup > 0 and s == warmup + p * period // fragments
                pending = (p, g, s, plain, flat(p))
        equal.append(_same(list(ours_model.parameters()), list(ref_model.parameters())))
        if ours.merged:
            common.append(torch.cat([t.reshape(-1) for t in ours.common_tensors()]))
    return equal, common, ours.comm_levels()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_delayed_mixed_merges_match_a_blocking_reference_bit_for_bit():
    results = run_distributed(_reference_worker, 2, 26, 3, 8, 2, 0.5)
    for equal, _, _ in results:
        assert all(equal), equal.index(False)
    (_, common0, _), (_, common1, _) = results
    assert len(common0) == 6 and _same(common0, common1)  # the anchors, on every rank
    # eager rounds (no warmup: no blocking first round), written out with a blocking all-reduce
    results = run_distributed(_reference_worker, 2, 26, 0, 8, 0, 0.25, True)
    for equal, _, _ in results:
        assert all(equal), equal.index(False)
    (_, common0, _), (_, common1, _) = results
    assert len(common0) == 5 and _same(common0, common1)  # rounds 3-7 received a mean
    # merge_rule=progress: the new anchor plus this rank's progress over the τ=2 steps
    results = run_distributed(_reference_worker, 2, 26, 3, 8, 2, 0.0, False, None, "progress")
    for equal, _, _ in results:
        assert all(equal), equal.index(False)
    (_, common0, _), (_, common1, _) = results
    assert len(common0) == 6 and _same(common0, common1)  # the anchors only: locals differ


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_inner_levels_compose_with_delayed_mixed_fragments_bit_for_bit():
    # 4 workers, pairs average the whole model after every step s >= 2 with s % 3 == 0; the
    # fragments launch after 2, 10, 18 (0) and 6, 14, 22 (1) and merge one step later: the pairs'
    # averages fall on launches (6, 18) and on merges (3, 15), where they come first
    steps, warmup = 24, 2
    results = run_distributed(_reference_worker, 4, steps, warmup, 8, 1, 0.5, False, (3, 2))
    for equal, _, _ in results:
        assert all(equal), equal.index(False)
    commons = [common for _, common, _ in results]
    assert len(commons[0]) == 6 and all(_same(commons[0], c) for c in commons[1:])
    inner, widest = results[0][2]
    numel = sum(t.numel() for t in _net().parameters())
    pairs = sum(1 for s in range(warmup, steps) if s % 3 == 0)
    assert (inner["group_size"], inner["period"], inner["rounds"]) == (2, 3, pairs)
    assert inner["bytes"] == 4 * numel * pairs  # the whole model, in fp32
    assert (widest["group_size"], widest["period"], widest["rounds"]) == (4, 8, 6)
    assert widest["bytes"] == 3 * 4 * numel  # each fragment three times: the model three times


# --- (5) resume with a fragment in flight, and eager rounds ---------------------------------------


def _levels_averager(model, opt, world_size):
    """Built from the config, as the trainer does: pairs every 3 steps, then streaming at the
    widest level (H = 8, warmup 2, fragment 0 launched after step 10 and merged after 12)."""
    sync = SyncConfig(
        warmup_steps=2,
        levels=[SyncLevel(group_size=2, period=3), SyncLevel(group_size="world", period=8)],
        outer="diloco",
        fragments=2,
        delay_steps=2,
        merge_alpha=0.5,
    )
    return build_averager(sync, model, opt, world_size, world_size, CommStats())


def _resume_worker(
    rank, world_size, steps, save_at, names=("delayed", "eager", "plain", "progress")
):
    torch.set_num_threads(1)
    configs = {
        "delayed": dict(fragments=2, delay_steps=2, merge_alpha=0.5),
        "eager": dict(fragments=2, eager=True, merge_alpha=0.25),
        "plain": dict(fragments=4, delay_steps=1, outer=False),
        "progress": dict(fragments=2, delay_steps=2, merge_rule="progress"),
        "levels": None,
    }
    out = {}
    for name in names:

        def build(kw=configs[name]):
            model = _net(bn=True)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            if kw is None:
                return model, opt, _levels_averager(model, opt, world_size)
            return model, opt, StreamingAverager(8, 2, module=model, **kw)

        def run(model, opt, avg, gen, start, stop, commons):
            for _ in range(start, stop):
                _step(model, opt, gen)
                avg.maybe_average()
                if avg.merged:
                    commons.append(torch.cat([t.reshape(-1) for t in avg.common_tensors()]))

        model, opt, avg = build()
        gen = torch.Generator().manual_seed(7 + rank)
        commons: list[torch.Tensor] = []
        run(model, opt, avg, gen, 0, steps, commons)
        straight = _state(model)

        model, opt, avg = build()
        gen = torch.Generator().manual_seed(7 + rank)
        run(model, opt, avg, gen, 0, save_at, [])
        in_flight = any(avg.rounds.holding)
        buf = io.BytesIO()
        torch.save([model.state_dict(), opt.state_dict(), avg.state_dict(), gen.get_state()], buf)
        buf.seek(0)
        model, opt, avg = build()
        saved = torch.load(buf, weights_only=False)
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        avg.load_state_dict(saved[2])
        gen = torch.Generator()
        gen.set_state(saved[3])
        run(model, opt, avg, gen, save_at, steps, [])
        out[name] = (in_flight, _same(straight, _state(model)), commons, avg.comm_levels())
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_with_a_fragment_in_flight_is_bit_identical():
    # warmup 2, H 8: fragment 0 launches after step 10 in every config; saved after step 10
    r0, r1 = run_distributed(_resume_worker, 2, 22, 11)
    for name in r0:
        assert r0[name][0], name  # something was in flight at the save
        assert r0[name][1] and r1[name][1], name
        assert r0[name][2] and _same(r0[name][2], r1[name][2]), name  # common_tensors agree


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_under_inner_levels_with_a_fragment_in_flight_is_bit_identical():
    # 4 workers: the pairs' averages (after 3, 6, 9, 12, ...) around the step-10 launch
    results = run_distributed(_resume_worker, 4, 22, 11, ("levels",))
    for r in results:
        in_flight, same, commons, levels = r["levels"]
        assert in_flight and same
        assert _same(commons, results[0]["levels"][2])  # what every rank shares, after each merge
        # the pairs averaged (after 3, 6, ..., 21) and the counters came through the checkpoint
        assert [(lv["group_size"], lv["rounds"]) for lv in levels] == [(2, 7), (4, 5)]

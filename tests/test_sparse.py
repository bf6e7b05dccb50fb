"""Sparse pseudo-gradients (`sync.compress=topk`, SparseLoCo): chunked top-k with 2-bit values,
error feedback that conserves the signal, bytes counted exactly, every rank decoding the same
bits (DiLoCo, Streaming DiLoCo's launched fragments, hierarchical levels), resume, and the
config's refusals. Each test fails without the feature it names. Through torchft:
tests/test_ft_cli.py (SPARSELOCO, `make test-long`)."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging import (
    CommStats,
    HierarchicalAverager,
    OuterAverager,
    PeriodicAverager,
    SparseWire,
    StreamingAverager,
    TopKCodec,
)
from localsgd.cli.checks import validate
from localsgd.cli.launch import run_on_workers
from localsgd.config import ConfigError
from localsgd.loop.plan import SyncPlan
from localsgd.loop.strategies import build_averager
from tests.helpers import compose_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lone_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Net(torch.nn.Module):
    """6 * 40 + 40 + 2 * (40 * 40 + 40) + 40 * 3 = 3680 fp32 values: 15 chunks of 256 values,
    the last one padded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 40)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(40, 40) for _ in range(2)])
        self.out = torch.nn.Linear(40, 3, bias=False)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def _step(model, opt, gen):
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


CODEC = TopKCodec(density=1 / 16, chunk=256)  # k = 16 of every 256


# --- the codec ------------------------------------------------------------------------------------


def test_the_message_holds_the_top_k_of_each_chunk_in_2_bits():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=gen)
    codec = TopKCodec(density=0.05, chunk=100)  # k = 5
    message = codec.quantize(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.wire_bytes(1000)
    y = codec.dequantize(message, 1000)
    for c in range(10):
        xs, ys = x[c * 100 : (c + 1) * 100], y[c * 100 : (c + 1) * 100]
        top = set(xs.abs().topk(5).indices.tolist())
        assert set(ys.nonzero().flatten().tolist()) <= top  # only the top-k are sent
        scale = xs.abs().max()
        levels = torch.tensor([-1, -1 / 3, 1 / 3, 1]) * scale
        sent = ys[ys != 0]
        assert all(torch.isclose(levels, v).any() for v in sent)  # 2 bits: four levels
        err = (ys - xs)[list(top)].abs()
        assert (err <= scale / 3 * (1 + 1e-6)).all()
    assert torch.equal(codec.dequantize(codec.quantize(torch.zeros(10)), 10), torch.zeros(10))


def test_byte_counts_are_exact(lone_group):
    """4 bytes of scale per chunk, the Elias-Fano indices (k l + k + (C >> l) bits a chunk,
    l = floor(log2(C / k)), packed and padded to a byte), 2 bits per value sent: the message is
    that long, and `comm_bytes` grows by exactly the messages of every flat buffer."""
    n, codec = 3680, CODEC
    chunks = math.ceil(n / 256)
    index_bits = 16 * 4 + 16 + (256 >> 4)  # l = 4: 96 bits, 6 an index (int16 took 16)
    expected = 4 * chunks + math.ceil(index_bits * chunks / 8) + math.ceil(16 * chunks / 4)
    assert codec.wire_bytes(n) == expected == 15 * 4 + 15 * 12 + 60
    assert codec.quantize(torch.randn(n)).numel() == expected
    # the default, 64 of 4096: 4 + (384 + 128) / 8 + 16 = 84 bytes a chunk; 60 of 4096 (l = 6):
    # 484 index bits a chunk, so 3 chunks pack into ceil(1452 / 8) = 182 bytes
    assert TopKCodec().wire_bytes(4096 * 53) == 84 * 53
    assert TopKCodec(60 / 4096).wire_bytes(3 * 4096) == 12 + 182 + 45
    assert TopKCodec(60 / 4096).quantize(torch.randn(3 * 4096)).numel() == 239
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = CommStats()
    averager = OuterAverager(1, module=model, comm_dtype=codec, error_feedback=True, stats=stats)
    per_round = sum(codec.wire_bytes(b.numel()) for b in averager.flat.buffers)
    assert per_round == expected  # one fp32 buffer
    gen = torch.Generator().manual_seed(2)
    for r in range(1, 4):
        _step(model, opt, gen)
        averager.maybe_average()
        assert stats.bytes == r * per_round


def _old_decode(x: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """What the int16-index wire decoded `x` to (its arithmetic written out): the top-k of each
    zero-padded chunk at the nearest of -1, -1/3, 1/3, 1 times their largest magnitude."""
    n = x.numel()
    chunks = torch.zeros(math.ceil(n / chunk) * chunk).index_copy_(0, torch.arange(n), x)
    chunks = chunks.view(-1, chunk)
    index = chunks.abs().topk(k, dim=1).indices
    top = chunks.gather(1, index)
    scale = top.abs().amax(1)
    code = (top / scale.masked_fill(scale == 0, 1).unsqueeze(1) * 1.5 + 1.5).round().clamp(0, 3)
    value = (code * 2 - 3) / 3 * scale.unsqueeze(1)
    return torch.zeros_like(chunks).scatter_(1, index, value).view(-1)[:n]


@pytest.mark.parametrize(
    "n, chunk, k",
    [
        (3680, 256, 16),
        (214996, 4096, 64),
        (5000, 64, 64),
        (777, 2, 1),
        (12293, 4096, 60),
        (1000, 100, 5),
    ],
)
def test_the_decoded_values_are_the_int16_wires_bits(n, chunk, k):
    """Elias-Fano changes how the positions are written, not which: every value decodes to
    the same bits as with the int16 indices before it (so the sum in rank order is too)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    codec = TopKCodec(k / chunk, chunk)
    assert codec.k == k
    got = codec.dequantize(codec.quantize(x), n)
    assert torch.equal(got.view(torch.int32), _old_decode(x, k, chunk).view(torch.int32))


def _positions(chunk: int, k: int, gen: torch.Generator) -> list[list[int]]:
    """Chunks of positions that test the coding's edges: random ones, runs of adjacent ones from
    the first position and up to the last, the first and last together, and a last chunk one
    value short (the zero-padded position left out unless every position is kept)."""

    def some(m: int, count: int) -> list[int]:
        return torch.randperm(m, generator=gen)[:count].tolist()

    picks = [some(chunk, k) for _ in range(3)]
    picks += [list(range(k)), list(range(chunk - k, chunk))]
    if k >= 2:
        picks.append([0, chunk - 1, *(p + 1 for p in some(chunk - 2, k - 2))])
    short = chunk - 1  # values in the last chunk
    picks.append(list(range(chunk)) if k == chunk else [short - 1, *some(short - 1, k - 1)])
    return picks


@pytest.mark.parametrize(
    "chunk, k",
    [
        (4096, 64),
        (4096, 60),
        (4096, 1),
        (64, 64),
        (100, 7),
        (2, 1),
        (2, 2),
        (256, 255),
        (1 << 20, 3),
    ],
)
def test_elias_fano_round_trips_the_sorted_positions(chunk, k):
    """The k positions each chunk keeps, coded and decoded: exactly the picked positions,
    ascending, for random picks, positions 0 and chunk - 1, adjacent runs, k = 1, k = chunk
    (every position), the largest chunk allowed and a last chunk cut short; and the values land
    where they were; a message whose bitmap does not hold k positions a chunk is refused."""
    from localsgd.averaging.wire.sparse import MAX_CHUNK

    gen = torch.Generator().manual_seed(chunk * 7 + k)
    picks = _positions(chunk, k, gen)
    n = chunk * len(picks) - 1
    expected = torch.tensor([sorted(pick) for pick in picks])
    where = (expected + torch.arange(len(picks)).unsqueeze(1) * chunk).flatten()
    where = where[where < n]
    x = torch.rand(n, generator=gen) * 1e-3  # below every picked magnitude
    x[where] = (torch.rand(where.numel(), generator=gen) + 1) * torch.randn(
        where.numel(), generator=gen).sign()  # fmt: skip
    codec = TopKCodec(k / chunk, chunk)
    assert codec.k == k and chunk <= MAX_CHUNK
    sender, receiver = codec.wire(n, "cpu"), codec.wire(n, "cpu")
    sender.encode_(x)
    decoded = receiver.decode(sender.send.clone())
    assert torch.equal(sender.index, expected)
    assert torch.equal(receiver.index, expected)
    assert torch.equal(decoded.nonzero().flatten(), where)
    assert torch.equal(decoded, codec.dequantize(codec.quantize(x), n))
    # one bitmap bit flipped: refused, not decoded to positions outside the chunk
    broken = sender.send.clone()
    first = codec.low_bits * k  # the first chunk's first bitmap bit, in the index bytes
    broken[receiver.index_start + first // 8] ^= 1 << (first % 8)
    with pytest.raises(ValueError, match="not a top-k message of this wire"):
        receiver.decode(broken)


def test_error_feedback_conserves_the_signal(lone_group):
    """Over 20 rounds, what was sent plus the residual left is the sum of the true
    pseudo-gradients, to 1e-6: top-k delays what it does not send, it never loses it."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = OuterAverager(
        1, module=model, comm_dtype=CODEC, error_feedback=True, outer_lr=1.0,
        outer_momentum=0.0, outer_nesterov=False,
    )  # fmt: skip
    rounds = averager.rounds
    gen = torch.Generator().manual_seed(3)
    true_sum = torch.zeros(averager.flat.buffers[0].numel(), dtype=torch.float64)
    sent_sum = torch.zeros_like(true_sum)
    for _ in range(20):
        _step(model, opt, gen)
        true_sum += (rounds.anchors.first[0] - averager.flat.buffers[0]).double()
        averager.maybe_average()
        wire = rounds.wires[0].low[0]
        assert isinstance(wire, SparseWire)
        sent_sum += wire.decode(wire.send).double()
    residual = rounds.residuals[0][0].double()
    assert residual.abs().max() > 1e-3  # most of the signal waits in the residual
    assert (sent_sum + residual - true_sum).abs().max() <= 1e-6


def test_a_decayed_residual_follows_sparselocos_accumulator(lone_group):
    """`sync.error_feedback_decay` = beta: each round the residual becomes beta * residual +
    pseudo-gradient - sent (e <- beta e + d; send top-k of e; e <- e - sent), to 1e-6."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = OuterAverager(1, module=model, comm_dtype=CODEC, error_feedback=True,
                             error_feedback_decay=0.9)  # fmt: skip
    rounds = averager.rounds
    gen = torch.Generator().manual_seed(6)
    for _ in range(6):
        _step(model, opt, gen)
        true = (rounds.anchors.first[0] - averager.flat.buffers[0]).double()
        before = rounds.residuals[0][0].double()
        averager.maybe_average()
        wire = rounds.wires[0].low[0]
        sent = wire.decode(wire.send).double()
        expected = 0.9 * before + true - sent
        assert (rounds.residuals[0][0].double() - expected).abs().max() <= 1e-6
    assert rounds.residuals[0][0].abs().max() > 1e-3


def test_resume_continues_bit_identically(lone_group):
    """The residuals are checkpointed: a fresh averager loaded from `state_dict()` continues
    with the same bits."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = OuterAverager(2, module=model, comm_dtype=CODEC, error_feedback=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        _step(model, opt, gen)
        averager.maybe_average()
    state, params = copy.deepcopy(averager.state_dict()), copy.deepcopy(model.state_dict())
    assert state["rounds"]["residuals"][0][0].abs().max() > 0
    twin = _Net()
    twin_averager = OuterAverager(2, module=twin, comm_dtype=CODEC, error_feedback=True)
    twin.load_state_dict(params)
    twin_averager.load_state_dict(state)
    for m, a in ((model, averager), (twin, twin_averager)):
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            _step(m, o, g)
            a.maybe_average()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
               twin.state_dict().values(), strict=True))  # fmt: skip


def test_the_senders_mean_divides_each_index_by_the_workers_that_sent_it():
    """`mean="senders"` (SparseLoCo's reference aggregation): three workers' messages, decoded
    and summed in rank order, each index divided by how many of them sent it (an index one
    worker sent keeps its whole value; one nobody sent stays 0); `mean="all"` divides by 3.
    With weights, each index by the weight of its senders."""
    from localsgd.averaging.comm import decode_mean_

    n, members = 40, 3
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=gen) for _ in range(members)]
    xs[0][:4] = 50.0  # index 0..3: every worker's top values, so sent by all three
    xs[1][:4] = 60.0
    xs[2][:4] = 70.0
    for mean in ("all", "senders"):
        codec = TopKCodec(density=0.2, chunk=20, mean=mean)  # k = 4 of every 20
        wire = codec.wire(n, "cpu")
        gathered = torch.cat([codec.quantize(x) for x in xs])
        decoded = [codec.dequantize(codec.quantize(x), n) for x in xs]
        total = torch.stack(decoded).sum(0)
        count = torch.stack([(d != 0).float() for d in decoded]).sum(0)
        out = torch.empty(n)
        assert decode_mean_(out, wire, gathered, members, members) == []
        if mean == "all":
            assert torch.allclose(out, total / members, rtol=0, atol=1e-6)
        else:
            assert count.max() == 3 and (count == 1).sum() > 0 and (count == 0).sum() > 0
            assert torch.allclose(out, total / count.clamp(min=1), rtol=0, atol=1e-6)
            assert torch.equal(out[count == 0], torch.zeros(int((count == 0).sum())))
            weights = [1.0, 2.0, 3.0]
            weighted = sum(w * d for w, d in zip(weights, decoded, strict=True))
            weight = sum(w * (d != 0).float() for w, d in zip(weights, decoded, strict=True))
            decode_mean_(out, wire, gathered, members, members, weights=weights)
            assert torch.allclose(out, weighted / weight.clamp(min=1), rtol=0, atol=1e-5)
            bad = xs[2].clone()
            bad[0] = float("nan")  # rank 2's first chunk decodes to NaN: left out, uncounted
            gathered = torch.cat([codec.quantize(x) for x in (xs[0], xs[1], bad)])
            assert decode_mean_(out, wire, gathered, members, members, guard=True) == [2]
            two = (decoded[0] + decoded[1]) / (
                (decoded[0] != 0).float() + (decoded[1] != 0).float()
            ).clamp(min=1)
            assert torch.allclose(out, two, rtol=0, atol=1e-6)


# --- the config -----------------------------------------------------------------------------------


def test_the_config_builds_top_k_and_the_sparseloco_preset(lone_group):
    cfg = compose_config(["sync=sparseloco", "sync.topk_chunk=256", "sync.period=2"])
    validate(cfg)
    plan = SyncPlan.of(cfg.sync)
    assert (plan.compress, plan.outer_lr, plan.outer_momentum) == ("topk", 1.0, 0.0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = build_averager(cfg.sync, model, opt, 1, 1, CommStats())
    assert averager.comm_dtype == TopKCodec(1 / 64, 256)
    assert isinstance(averager.rounds.wires[0].low[0], SparseWire)
    senders = compose_config(["sync=sparseloco", "sync.topk_mean=senders"])
    validate(senders)
    validate(compose_config(["sync=sparseloco", "dist.shard_size=2", "dist.world_size=4"]))
    averager = build_averager(senders.sync, model, opt, 1, 1, CommStats())
    assert averager.comm_dtype == TopKCodec(1 / 64, 4096, "senders") != TopKCodec(1 / 64, 4096)
    assert averager.rounds.wires[0].low[0].senders is not None
    plain = compose_config(["sync.compress=topk", "sync.error_feedback=true", "sync.period=2"])
    averager = build_averager(plain.sync, model, opt, 1, 1, CommStats())
    assert isinstance(averager, PeriodicAverager)
    # plain local SGD sends the change
    assert isinstance(averager.rounds.wires[0].low[0], SparseWire)


@pytest.mark.timeout(30)
def test_top_k_turns_error_feedback_on_by_itself_and_no_other_wire_does(lone_group):
    # null (the default): on where top-k needs it; an explicit false is refused (below)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    topk = compose_config(["sync=diloco", "sync.compress=topk"])
    validate(topk)
    averager = build_averager(topk.sync, model, opt, 1, 1, CommStats())
    assert all(r is not None for r in averager.rounds.wires[0].residuals)
    for overrides in (["sync=diloco", "sync.comm_dtype=int4"], ["sync=diloco"]):
        plan = SyncPlan.of(compose_config(overrides).sync)
        assert plan.error_feedback is False, overrides


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sync.compress=gzip"], "sync.compress"),
        (
            ["sync.compress=topk", "sync.error_feedback=false"],
            "sync.compress=topk with sync.error_feedback=false",
        ),
        (["sync=sparseloco", "sync.comm_dtype=int4"], "sync.compress=topk with sync.comm_dtype"),
        (["sync=sparseloco", "sync.topk_density=0"], "sync.topk_density"),
        (["sync=sparseloco", "sync.error_feedback_decay=1.5"], "sync.error_feedback_decay"),
        (["sync.error_feedback_decay=0.9"], "sync.error_feedback_decay < 1"),
        (["sync=sparseloco", "sync.topk_chunk=2000000"], "sync.topk_chunk"),
        (["sync=sparseloco", "sync.topk_mean=median"], "sync.topk_mean"),
        (
            ["sync=sparseloco", "sync.topk_mean=senders", "sync.aggregate=median"],
            "sync.compress=topk with sync.aggregate=",
        ),
    ],
)
def test_what_cannot_hold_is_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(overrides))
    line = str(e.value)
    assert "\n" not in line and key in line, line


# --- every rank decodes the same bits (2 processes) ---------------------------------------------


def _same(buffers: list[torch.Tensor]) -> bool:
    for flat in buffers:
        out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(out, flat)
        if not all(torch.equal(out[0], o) for o in out[1:]):
            return False
    return True


def _ranks_worker(rank, world_size):
    torch.set_num_threads(1)
    out = {}
    for kind in ("diloco", "fragments", "levels"):
        model = _Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind == "diloco":
            averager = OuterAverager(2, module=model, comm_dtype=CODEC, error_feedback=True)
        elif kind == "levels":  # each rank alone every 2 steps, both every 4
            averager = HierarchicalAverager(
                OrderedDict([(2, 1), (4, 2)]), module=model, comm_dtype=CODEC, error_feedback=True
            )
        else:  # Streaming DiLoCo: 2 fragments, each launched and merged one step late
            averager = StreamingAverager(
                4, module=model, fragments=2, delay_steps=1, comm_dtype=CODEC, error_feedback=True
            )
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
        same = []
        for _ in range(8):
            _step(model, opt, gen)
            global_sync = averager.averages_all(averager.step)
            averaged = averager.maybe_average()
            if (kind == "levels" and global_sync) or (kind == "diloco" and averaged):
                same.append(_same(averager.flat.buffers))
            elif kind == "fragments" and averager.merged:
                same.append(_same(averager.common_tensors()))
        out[kind] = same
    return out


@pytest.mark.slow
def test_every_rank_decodes_the_same_bits():
    for per_rank in run_on_workers(_ranks_worker, 2, timeout_s=60):
        assert per_rank["diloco"] == [True] * 4  # the averages after steps 0, 2, 4, 6
        assert per_rank["fragments"] == [True] * len(per_rank["fragments"])
        assert len(per_rank["fragments"]) >= 3
        assert per_rank["levels"] == [True] * 2  # the global averages after steps 0 and 4


def test_runs_sent_with_int16_indices_are_restated_exactly():
    """`localsgd.analysis.restate`: a top-k run's `comm_bytes` from the int16-index wire (4 of
    scale, 2 an index, 2 bits a value) becomes whole rounds of today's messages; today's counts
    stay; a count that is whole rounds of neither is refused."""
    from localsgd.analysis.restate import int16_wire_bytes, restate_run

    assert int16_wire_bytes(CODEC, 3680) == 15 * 4 + 2 * 16 * 15 + 60
    # sparseloco_h16_sb95, seed 0, as runs.jsonl keeps it: 126 rounds of 148 x 53 bytes
    config = {"sync.compress": "topk", "sync.topk_density": 0.015625, "sync.topk_chunk": 4096}
    summary = {"comm_bytes": 988344, "comm_rounds": 126, "params": 214996}
    metrics = [{"step": 16, "comm_bytes": 2 * 7844}, {"step": 17, "loss": 3.0}]
    assert restate_run(summary, config, metrics)
    assert summary["comm_bytes"] == 126 * 84 * 53 and metrics[0]["comm_bytes"] == 2 * 84 * 53
    assert not restate_run(summary, config)  # today's count stays
    assert not restate_run({"comm_bytes": 5, "comm_rounds": 1, "params": 9}, {})  # not top-k
    with pytest.raises(ValueError, match="not 126 rounds"):
        restate_run({"comm_bytes": 988345, "comm_rounds": 126, "params": 214996}, config)

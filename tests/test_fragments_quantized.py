"""Streaming DiLoCo's fragments below fp32 (each fragment's wire stage, `rounds.wire.Wire`): 4-bit
and 16-bit pseudo-gradients, blocking, delayed and eager, with error feedback; bytes as sent;
resume."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from localsgd.averaging.comm import supports_avg
from localsgd.averaging.streaming.averager import StreamingAverager
from localsgd.averaging.streaming.fragments import fragment_ids
from localsgd.averaging.wire.quantize import BlockCodec
from localsgd.cli.checks import validate
from tests.helpers import compose_config, killed_and_resumed, run_distributed
from tests.test_comm_frontier_cli import STREAMING


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net(width: int = 8) -> Net:
    torch.manual_seed(0)
    return Net(width)


def _step(model, opt, gen) -> None:
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _launch_fragment(s: int, warmup: int, period: int, fragments: int) -> int | None:
    for p in range(fragments):
        if s >= warmup and (s - warmup - p * period // fragments) % period == 0:
            return p
    return None


# --- what the checks let through, and what is refused -------------------------------------------


@pytest.mark.timeout(60)
def test_streaming_accepts_formats_below_fp32_and_feedback_needs_one():
    streaming = ["sync.period=8", "sync.fragments=2", "sync.delay_steps=1", "sync.merge_alpha=0.5"]
    for fmt in ("float4_e2m1", "int4", "int8", "float8_e4m3fn", "bfloat16", "float16"):
        for ef in ("true", "false"):
            cfg = compose_config(
                streaming
                + ["sync.outer=diloco", f"sync.comm_dtype={fmt}", f"sync.error_feedback={ef}"]
            )
            validate(cfg, world_size=2)
    # plain streaming sends each fragment's change since its last sync: low-bit too
    validate(compose_config(streaming + ["sync.outer=none", "sync.comm_dtype=int4"]), 2)
    with pytest.raises(ValueError, match="error_feedback needs"):
        StreamingAverager(8, module=_net(), fragments=2, error_feedback=True)


# --- (a) bit-identical to a reference with blocking exchanges, written with the codec ---------


def _reference_worker(rank, world_size, steps, configs):
    torch.set_num_threads(1)
    out = {}
    for name, (fmt, warmup, delay, alpha, ef, eager) in configs.items():
        period, fragments = 8, 2
        ours_model, ref_model = _net(), _net()
        ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=0.01)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.01)
        ours = StreamingAverager(
            period, warmup, module=ours_model, fragments=fragments, delay_steps=delay,
            merge_alpha=alpha, eager=eager, comm_dtype=fmt, error_feedback=ef,
        )  # fmt: skip
        ids = fragment_ids(ref_model, fragments)
        params = list(ref_model.parameters())
        members = [[t for t, f in zip(params, ids, strict=True) if f == p] for p in range(2)]

        def flat(p, members=members):
            return torch.cat([t.detach().reshape(-1) for t in members[p]])

        anchors = [flat(p) for p in range(fragments)]
        residuals = [torch.zeros_like(a) for a in anchors]
        outer = [torch.optim.SGD([a], lr=0.7, momentum=0.9, nesterov=True) for a in anchors]

        def mean(g, p, fmt=fmt, ef=ef, residuals=residuals):
            """The blocking exchange, written out: encode, all-gather, decode, sum in rank
            order, divide (16 bits: cast, all-reduce, cast back)."""
            if ef:
                g.add_(residuals[p])
            if fmt == "bfloat16":
                low = g.to(torch.bfloat16)
                if ef:
                    residuals[p] = g - low.float()
                if supports_avg(None):
                    dist.all_reduce(low, op=dist.ReduceOp.AVG)
                else:
                    dist.all_reduce(low.div_(world_size))
                return low.float()
            codec = BlockCodec(fmt)
            msg = codec.quantize(g)
            if ef:
                residuals[p] = g - codec.dequantize(msg, g.numel())
            gathered = [torch.empty_like(msg) for _ in range(world_size)]
            dist.all_gather(gathered, msg)
            acc = codec.dequantize(gathered[0], g.numel())
            for m in gathered[1:]:
                acc.add_(codec.dequantize(m, g.numel()))
            return acc.div_(world_size)

        gens = [torch.Generator().manual_seed(5 + rank) for _ in range(2)]
        pending, equal, common = None, [], []
        delayed = [(torch.zeros_like(a), torch.zeros_like(a)) for a in anchors]

        def merge(p, avg, plain, alpha=alpha, anchors=anchors, outer=outer, members=members):
            if plain:
                anchors[p].sub_(avg)
            else:
                anchors[p].grad = avg
                outer[p].step()
            merged = flat(p).mul_(alpha).add_(anchors[p], alpha=1 - alpha)
            torch.nn.utils.vector_to_parameters(merged, members[p])

        for s in range(steps):
            _step(ours_model, ours_opt, gens[0])
            ours.maybe_average()
            _step(ref_model, ref_opt, gens[1])
            with torch.no_grad():
                if pending is not None and s == pending[2] + delay:
                    merge(pending[0], pending[1], pending[3])
                    pending = None
                p = _launch_fragment(s, warmup, period, fragments)
                if eager and p is not None:  # d/M + D_prev - d_prev/M, D one round late
                    d = anchors[p] - flat(p)
                    received = mean(d.clone(), p)
                    own, late = delayed[p]
                    anchors[p].grad = own.div(-world_size).add_(late).add_(d, alpha=1 / world_size)
                    outer[p].step()
                    merged = flat(p).mul_(alpha).add_(anchors[p], alpha=1 - alpha)
                    torch.nn.utils.vector_to_parameters(merged, members[p])
                    delayed[p] = (d, received)
                elif p is not None:
                    g = mean(anchors[p] - flat(p), p)
                    pending = (p, g, s, warmup > 0 and s == warmup + p * period // fragments)
                    if delay == 0:  # merged at once
                        merge(pending[0], pending[1], pending[3])
                        pending = None
            equal.append(_same(list(ours_model.parameters()), list(ref_model.parameters())))
            if ours.merged:
                common.append(torch.cat([t.reshape(-1) for t in ours.common_tensors()]))
        out[name] = (equal, common)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quantized_fragments_match_a_blocking_reference_bit_for_bit():
    configs = {  # fmt, warmup, τ, α, error feedback, eager
        "4bit": ("float4_e2m1", 3, 1, 0.5, False, False),
        "4bit_ef": ("float4_e2m1", 3, 1, 0.5, True, False),
        "int8_blocking": ("int8", 3, 0, 0.5, True, False),
        "bf16_ef": ("bfloat16", 3, 1, 0.5, True, False),
        "4bit_eager_ef": ("float4_e2m1", 0, 0, 0.25, True, True),
    }
    r0, r1 = run_distributed(_reference_worker, 2, 26, configs)
    for name in configs:
        for equal, _ in (r0[name], r1[name]):
            assert all(equal), (name, equal.index(False))
        common0, common1 = r0[name][1], r1[name][1]
        assert len(common0) >= 5 and _same(common0, common1), name  # replicas agree


# --- (b) bytes per sync, (c) error feedback's invariant ---------------------------------------


def _bytes_worker(rank, world_size, rounds):
    torch.set_num_threads(1)
    period, fragments, delay = 4, 2, 1
    model = _net(width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = StreamingAverager(
        period, module=model, fragments=fragments, delay_steps=delay, merge_alpha=0.5,
        comm_dtype="float4_e2m1", error_feedback=True,
    )  # fmt: skip
    frags, codec = avg.rounds, BlockCodec("float4_e2m1")
    numels = [[e - s for _, s, _, e in rs] for rs in frags.parts]
    expected = [sum(codec.wire_bytes(n) for n in ns) for ns in numels]
    fp32 = [sum(4 * n for n in ns) for ns in numels]
    gen = torch.Generator().manual_seed(rank)
    sent_bytes, true_sum, sent_sum = [], None, None
    for s in range(rounds * period):
        _step(model, opt, gen)
        p = _launch_fragment(s, 0, period, fragments)
        if p == 0:  # fragment 0's true pseudo-gradient, anchor - local, before its launch
            true = torch.cat(
                [
                    frags.anchors.first[g][a:e] - avg.flat.buffers[g][a:e]
                    for g, a, _, e in frags.parts[0]
                ]
            ).double()
            true_sum = true if true_sum is None else true_sum + true
        before = avg.stats.bytes
        avg.maybe_average()
        sent_bytes.append(avg.stats.bytes - before)
        if p == 0:  # what this rank's messages decode to
            sent = torch.cat(
                [codec.dequantize(w.send.clone(), w.numel) for w in frags.wires[0].low]
            ).double()
            sent_sum = sent if sent_sum is None else sent_sum + sent
    residual = torch.cat(list(frags.residuals[0])).double()
    return {
        "expected": expected,
        "fp32": fp32,
        "sent": sent_bytes,
        "error": (sent_sum + residual - true_sum).abs().max().item(),
        "residual": residual.abs().max().item(),
        "true": true_sum.abs().max().item(),
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_4bit_fragment_bytes_and_error_feedback():
    rounds, period, fragments = 20, 4, 2
    r0, r1 = run_distributed(_bytes_worker, 2, rounds)
    for r in (r0, r1):
        for s, nbytes in enumerate(r["sent"]):  # (b) each sync sends its fragment's message
            p = _launch_fragment(s, 0, period, fragments)
            assert nbytes == (0 if p is None else r["expected"][p]), s
        assert all(e <= 0.14 * f for e, f in zip(r["expected"], r["fp32"], strict=True))
        # (c) over 20 rounds: sum(sent) + residual == sum(true pseudo-gradients)
        assert r["residual"] > 0 and r["true"] > 0
        assert r["error"] < 1e-6, r["error"]


# --- (d) kill and resume with a 4-bit fragment in flight and error feedback -------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_4bit_streaming_with_error_feedback_resumes_bit_identical(tmp_path):
    # STREAMING: the step-10 checkpoint holds fragment 1 in flight (see test_comm_frontier_cli)
    args = STREAMING + ["sync.comm_dtype=float4_e2m1", "sync.error_feedback=true"]
    _, run_dir = killed_and_resumed(args, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    level = summary["comm_levels"][0]
    # every fragment sync (and the final blocking outer step) at 4 bits: well under fp32's
    assert level["bytes"] <= 0.14 * summary["params"] * 4 * level["rounds"]

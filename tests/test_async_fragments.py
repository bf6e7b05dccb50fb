"""Asynchronous Streaming DiLoCo (`sync.mode=async` with `sync.fragments`): each phase of
`period / P` steps sends one fragment's pseudo-gradient, in turn, and takes that fragment's
global values back.

- across 3 processes on their own modelled clocks, a run equals a one-process replay of the
  order the model fixes (to 1e-6): each fragment its own Delayed Nesterov, version and staleness,
  each contribution weighed by the samples since its fragment's last sync;
- from the CLI: every worker equally fast with a quorum of all and the synchronous outer step
  gives synchronous Streaming DiLoCo's model (τ = 0, α = 0) bit for bit, and each message
  carries one fragment; a run on unequal clocks resumes exactly after a SIGKILL.
"""

from __future__ import annotations

import json
from itertools import groupby

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging.asynchronous import AsyncAverager
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.wire.quantize import BlockCodec
from tests.helpers import BASE, FAST, killed_and_resumed, run_distributed
from tests.test_async_rounds import (
    BATCH,
    DELAY,
    OUTER,
    QUORUM,
    SPEEDS,
    STEPS,
    _heloco,
    _inner_step,
    same_as_synchronous,
)

pytestmark = pytest.mark.timeout(120)

PERIOD, P = 4, 2  # a phase of 2 steps, each fragment synced every 4 of a worker's steps


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # two blocks: fragment 0 the first layer, fragment 1 the second
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _worker(rank: int, world_size: int, wire: dict):
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = AsyncAverager(
        PERIOD, module=model, store=dist.distributed_c10d._get_default_store(),
        run_id="fragments", max_steps=STEPS, min_quorum=QUORUM, outer_delay=DELAY, step_s=1.0,
        speed=SPEEDS[rank], timeout_s=60, fragments=P, **OUTER, **wire,
    )  # fmt: skip
    sent = []
    for step in range(STEPS):
        if averager.computes():
            _inner_step(model, opt, rank, step)
            averager.trained(BATCH)
        before = averager.stats.bytes
        if averager.maybe_average() and step != STEPS - 1:
            sent.append(averager.stats.bytes - before)
    out = [p.detach().clone() for p in model.parameters()]
    return out, averager.summary(), averager.service.events if rank == 0 else None, sent


def _replay(
    codec: BlockCodec | None = None, keep: float | None = None, budget: float | None = None
) -> tuple[list[torch.Tensor], list[tuple]]:
    """One process: the three workers' phases in the order of their modelled send times (ties
    together, in rank order). Worker r sends after its first step and every PERIOD/P of its
    steps, fragment 0, 1, 0, ... in turn, weighed by the samples since that fragment's last
    sync; the last tick is a meeting of every fragment. A merge (once QUORUM workers are
    pending) steps each fragment with contributions: the weighted mean, Delayed Nesterov with
    N = DELAY, counted per fragment. With `codec`, each fragment's contribution (its
    parameters end to end) goes through it with that fragment's own residual; with `keep`,
    each is corrected by HeLoCo against its fragment's momentum before its merge; with
    `budget`, a phase ends after the first step and then where the worker's next step would
    pass budget / P modelled seconds (DyLU, each fragment's share of the time). Returns the
    final model and each merge's (time, contributions)."""
    models = [_model() for _ in SPEEDS]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    # fragment f: the f-th Linear's weight and bias (parameters 2f, 2f + 1)
    frag = [[0, 1], [2, 3]]
    theta = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(t) for t in theta]
    buffered = [torch.zeros_like(t) for t in theta]
    anchors = [[t.clone() for t in theta] for _ in SPEEDS]
    base = [[0] * P for _ in SPEEDS]
    versions, cycles = [0] * P, [0] * P
    unsynced = [[0] * P for _ in SPEEDS]
    residuals = [[0.0] * P for _ in SPEEDS]
    pending, log = [], []  # (worker, fragment, samples, change by parameter index)

    def merge(at: float) -> None:
        for f in range(P):
            mine = [(r, n, g) for r, q, n, g in pending if q == f]
            if not mine:
                continue
            if keep is not None:  # each contribution against the momentum before the merge
                mine = [
                    (r, n, {i: _heloco(g[i], momentum[i], keep) for i in frag[f]})
                    for r, n, g in mine
                ]
            total = sum(n for _, n, _ in mine)
            k = len(mine)
            cycles[f] += k
            plain = k / max(DELAY, k)
            for i in frag[f]:
                g = sum(c[i] * (n / total) for _, n, c in mine)
                buffered[i] += k * g
                if cycles[f] >= DELAY:
                    momentum[i].mul_(0.9).add_(buffered[i] / cycles[f])
                    theta[i] -= 0.7 * (plain * g + 0.9 * momentum[i])
                    buffered[i].zero_()
                else:
                    theta[i] -= 0.7 * plain * g
            cycles[f] = 0 if cycles[f] >= DELAY else cycles[f]
            versions[f] += 1
        log.append((at, len(pending)))
        pending.clear()

    events, todo = [], [[] for _ in SPEEDS]
    for r, speed in enumerate(SPEEDS):
        done, turn, phase = 0, 0, 0.0
        for tick in range(STEPS):
            if (done + 1) * speed <= tick + 1:
                done += 1
                phase += speed
                todo[r].append(tick)
                if budget:  # DyLU: after its first step too, then by time
                    ends = done == 1 or phase + speed > budget / P
                else:
                    ends = (done - 1) % (PERIOD // P) == 0
                if ends and tick != STEPS - 1:
                    events.append((done * speed, r, tick, [turn]))
                    turn = (turn + 1) % P
                    phase = 0.0
            if tick == STEPS - 1:
                events.append((done * speed, r, tick, list(range(P))))
    events.sort()  # by time, ties in rank order
    trained = [0] * len(SPEEDS)
    for at, group in groupby(events, key=lambda e: e[0]):
        group = list(group)
        for _, r, step, sent in group:
            ticks = [t for t in todo[r] if trained[r] <= t <= step]
            for t in ticks:
                _inner_step(models[r], opts[r], r, t)
            trained[r] = step + 1
            unsynced[r] = [n + BATCH * len(ticks) for n in unsynced[r]]
            local = [p.detach() for p in models[r].parameters()]
            change = [a - p for a, p in zip(anchors[r], local, strict=True)]
            for f in sent:
                sent_change = dict(enumerate(change))
                if codec is not None:  # the fragment's parameters end to end, through the codec
                    flat = torch.cat([change[i].reshape(-1) for i in frag[f]]) + residuals[r][f]
                    decoded = codec.dequantize(codec.quantize(flat), flat.numel())
                    residuals[r][f] = flat - decoded
                    pieces = decoded.split([theta[i].numel() for i in frag[f]])
                    for j, piece in zip(frag[f], pieces, strict=True):
                        sent_change[j] = piece.reshape(theta[j].shape)
                pending.append((r, f, unsynced[r][f], sent_change))
                unsynced[r][f] = 0
        if len({r for r, *_ in pending}) >= QUORUM:
            merge(at)
        for _, r, step, sent in group:
            if step == STEPS - 1:
                continue
            (f,) = sent
            if base[r][f] != versions[f]:
                for j in frag[f]:
                    anchors[r][j] = theta[j].clone()
                base[r][f] = versions[f]
            with torch.no_grad():
                for j, p in enumerate(models[r].parameters()):
                    if j in frag[f]:
                        p.copy_(anchors[r][j])
    if pending:  # the meeting merges what is left
        merge(events[-1][0])
    return theta, log


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["float32", "int8", "heloco", "time budget"])
def test_fragments_on_modelled_clocks_equal_the_one_process_replay_of_their_order(variant):
    codec = BlockCodec("int8") if variant == "int8" else None
    keep = 0.95 if variant == "heloco" else None  # high: this small model's blocks are corrected
    wire = {"comm_dtype": "int8", "error_feedback": True} if codec is not None else {}
    if keep is not None:
        wire["correction"] = HeLoCo(keep=keep)
    budget = 8.0 if variant == "time budget" else None  # phases of 4, 2 and 1 steps (DyLU)
    if budget is not None:
        wire["inner_time_s"] = budget
    results = run_distributed(_worker, 3, wire, timeout_s=90)
    expected, log = _replay(codec, keep, budget)
    for out, *_ in results:  # every worker ends on the final global model
        for got, want in zip(out, expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    events = results[0][2]
    assert [(e["time"], e["contributions"]) for e in events] == log
    assert max(e["max_staleness"] for e in events) >= 1  # stale fragments were merged
    if variant == "float32":  # each phase's message is one fragment's: 4x3+3 or 3x2+2 values
        assert {b for *_, sent in results for b in sent} == {15 * 4, 8 * 4}
    if keep is not None:  # the correction acted: without it the models differ
        assert results[0][1]["async_corrected_blocks"]["reoriented"] > 0
        plain, _ = _replay()
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(plain, expected, strict=True))


# --- from the CLI ----------------------------------------------------------------------------

# rounds of fragment 0 after steps 3, 7, ..., 19, of fragment 1 after 5, 9, ..., 21; the last
# step, 22, is a meeting, as synchronous Streaming DiLoCo's final average of every fragment
SAME = FAST + [
    "dist.world_size=4", "trainer.max_steps=23", "sync.warmup_steps=3", "sync.period=4",
    "sync.outer=diloco", "sync.fragments=2", "trainer.checkpoint_every=0",
    "trainer.eval_every=1000", "data.num_samples=800", "model.hidden=[16]",
    "trainer.log_every=4",
]  # fmt: skip


@pytest.mark.slow
def test_equal_clocks_with_a_full_quorum_are_synchronous_streaming_diloco_bit_for_bit(tmp_path):
    summary = same_as_synchronous(tmp_path, SAME)
    # 5 rounds of each fragment, then the meeting's two: every one a synchronous round
    assert summary["async_exchanges"]["collective"] == 11 and summary["async_merges"] == 12
    # the drift is measured around each fragment's synchronous round, as in the synchronous
    # schedule (the last line adds the meeting, a whole-model average the synchronous run's
    # final one does not measure)
    drift = {}
    for name in ("sync", "async"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        drift[name] = [(r["step"], r["drift"]) for r in map(json.loads, lines) if "drift" in r]
    assert len(drift["async"]) == 6 and drift["async"][:-1] == drift["sync"][:-1]


@pytest.mark.slow
def test_asynchronous_fragments_resume_exactly_after_a_kill(tmp_path):
    """Each fragment's version, the next fragment to send and the samples since each one's
    last sync are checkpointed at the meeting; the resumed run equals the uninterrupted one."""
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "sync.period=4", "sync.fragments=2",
                   "comm.simulate.worker_speed=[1,3]", "comm.simulate.step_s=0.002"]  # fmt: skip
    reference, _ = killed_and_resumed(args, tmp_path)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["async_merges"] > summary["async_exchanges"]["p2p"] / 2  # fragments merged


def test_the_syncer_merges_each_fragment_on_its_own():
    """Two fragments of one buffer (values 0-1 and 2-3), plain SGD at lr 1 (the global values
    are minus the sum merged): a merge steps only the fragments with contributions pending,
    each fragment counts its own version (a contribution's staleness is its fragment's), the
    staleness bound and a robust rule act per fragment, a fragment's samples count as its
    share of the model, and the checkpoint keeps each fragment's version."""
    from localsgd.averaging.asynchronous.hosted import build_syncer
    from localsgd.averaging.asynchronous.syncer import Arrival

    spec = {
        "buffers": [[4, "float32"]], "parts": [[[0, 0, 2, 2]], [[0, 2, 4, 4]]],
        "blocks": [[0, 0, 2], [0, 2, 2]],
        "sgd": {"lr": 1.0, "momentum": 0.0, "nesterov": False, "warmup_rounds": 0},
        "plain_first": False, "wire": {"dtype": "float32"}, "aggregate": {"rule": "median"},
        "correction": None, "normalized": False, "max_staleness": 0,
    }  # fmt: skip
    syncer, decoders = build_syncer({"spec": spec}, lambda t: t.zero_())
    assert len(decoders) == 2
    ones = torch.ones(2)
    syncer.add(Arrival(0, 1.0, 10, 0, [ones], 0))  # fragment 0 alone
    assert syncer.merge() and syncer.versions == [1, 0]
    assert torch.equal(syncer.values[0], torch.tensor([-1.0, -1.0, 0.0, 0.0]))
    # fragment 1's first contributions are fresh (version 0 of fragment 1), fragment 0's from
    # version 0 is one merge old: dropped by the bound of 0
    for worker, change in ((0, 1.0), (1, 2.0), (2, 6.0)):
        syncer.add(Arrival(worker, 2.0, 10, 0, [ones * change], 1))
    syncer.add(Arrival(3, 2.0, 10, 0, [ones * 50], 0))
    assert syncer.merge() and syncer.versions == [1, 1]
    # fragment 1 took the median of 1, 2, 6; fragment 0 is as it was
    assert torch.equal(syncer.values[0], torch.tensor([-1.0, -1.0, -2.0, -2.0]))
    assert syncer.too_stale == [(3, 2.0, 1)] and syncer.staleness == [0, 0, 0, 0]
    assert syncer.merged_samples == (10 + 30) / 2 and syncer.version == 2
    resumed, _ = build_syncer({"spec": spec}, lambda t: t.zero_())
    resumed.load_state_dict(syncer.state_dict())
    assert resumed.versions == [1, 1] and torch.equal(resumed.values[0], syncer.values[0])
    one = {**spec, "parts": [[[0, 0, 4, 4]]]}  # the checkpoint of another split: one line
    with pytest.raises(ValueError, match="sync.fragments"):
        build_syncer({"spec": one}, lambda t: t.zero_())[0].load_state_dict(syncer.state_dict())

"""Asynchronous outer rounds (`sync.mode=async`, `localsgd.averaging.asynchronous`).

- Delayed Nesterov: N = 1 is torch's Nesterov SGD op for op; N = 2 follows the formula;
- across 3 processes on their own modelled clocks, a run equals a one-process replay of the
  order the model fixes (to 1e-6), stale contributions and ties between two workers included;
- from the CLI: every worker equally fast with a quorum of all and the synchronous outer step
  gives synchronous DiLoCo's model bit for bit (4 workers: the all-reduce's ring order); a run
  on unequal clocks resumes exactly after a SIGKILL; bad keys are one line.
"""

from __future__ import annotations

import json
from itertools import groupby

import pytest
import torch
import torch.distributed as dist

from localsgd.averaging.asynchronous import AsyncAverager, DelayedNesterov
from localsgd.averaging.asynchronous.heloco import HeLoCo
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.wire.quantize import BlockCodec
from tests.faults import override
from tests.helpers import (
    BASE,
    FAST,
    cli,
    killed_and_resumed,
    refusal,
    run_distributed,
    same_model,
    train_records,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nesterov", [True, False])  # DiLoCo's; SlowMo's heavy-ball
@pytest.mark.parametrize(
    "delay, contributions",
    [(1, 1), (4, 4)],  # one contribution a merge and a cycle; every worker's in one merge
)
def test_delayed_nesterov_is_torch_sgd_where_each_merge_completes_a_cycle(
    delay, contributions, nesterov
):
    gen = torch.Generator().manual_seed(delay)
    start = torch.randn(50, generator=gen)
    a, b = start.clone().requires_grad_(), start.clone().requires_grad_()
    ours = DelayedNesterov([a], lr=0.7, momentum=0.9, delay=delay, nesterov=nesterov)
    ours.contributions = contributions
    torchs = torch.optim.SGD([b], lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(5):
        g = torch.randn(50, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        torchs.step()
        assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov", [True, False])
def test_delayed_nesterov_moves_the_momentum_every_n_merges(nesterov):
    theta = torch.zeros(3, requires_grad=True)
    opt = DelayedNesterov([theta], lr=0.5, momentum=0.9, delay=2, nesterov=nesterov)
    grads = [torch.tensor([1.0, 0, 0]), torch.tensor([0, 2.0, 0]), torch.tensor([0, 0, 4.0]),
             torch.tensor([8.0, 0, 0]), torch.tensor([0, 16.0, 0])]  # fmt: skip
    expected, m = torch.zeros(3), torch.zeros(3)
    for i, g in enumerate(grads, start=1):
        theta.grad = g
        opt.step()
        if i % 2 == 0:  # a cycle's end: m <- 0.9 m + its mean, the step g / 2 + 0.9 m
            before, m = m, 0.9 * m + (grads[i - 2] + g) / 2  # heavy-ball: the m before
            expected -= 0.5 * (g / 2 + 0.9 * (m if nesterov else before))
        else:
            expected -= 0.5 * g / 2
        assert torch.allclose(theta.detach(), expected, atol=1e-6), (i, theta, expected)


# --- the replay ------------------------------------------------------------------------------

SPEEDS = [1.0, 2.0, 3.0]  # modelled seconds a step
PERIOD, STEPS, BATCH, QUORUM, DELAY = 3, 24, 8, 2, 2
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 4, generator=gen)
    y = x @ torch.tensor([[1.0, -2.0], [0.5, 0.0], [0.0, 1.0], [2.0, 0.3]]) + 0.1 * rank
    return x, y


def _inner_step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _async_worker(rank: int, world_size: int, wire: dict):
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = AsyncAverager(
        PERIOD, module=model, store=dist.distributed_c10d._get_default_store(), run_id="replay",
        max_steps=STEPS, min_quorum=QUORUM, outer_delay=DELAY, step_s=1.0, speed=SPEEDS[rank],
        timeout_s=60, **OUTER, **wire,
    )  # fmt: skip
    for step in range(STEPS):
        if averager.computes():
            _inner_step(model, opt, rank, step)
            averager.trained(BATCH)
        averager.maybe_average()
    out = [p.detach().clone() for p in model.parameters()]
    return out, averager.summary(), averager.service.events if rank == 0 else None


def _heloco(d: torch.Tensor, m: torch.Tensor, keep: float) -> torch.Tensor:
    """HeLoCo's correction of one tensor as the paper's summary writes it (shrink 1, cap 0.5,
    reorient 0.5, kappa 1), its momentum an average: (1 - 0.9) x the sum the replay keeps."""
    nd, nm = d.norm(), m.norm()
    if nd == 0 or nm == 0:
        return d
    c = (d * m).sum() / (nd * nm)
    if c >= keep:
        return d
    conf = nd / (nd + 1.0 * (1 - 0.9) * nm + 1e-12)
    v = m / nm
    if c < 0:
        return d - min(1.0 * -c * conf, 0.5) * c * nd * v
    lam = min(0.5 * (1 - c) * conf, 1.0)
    u = (1 - lam) * d / nd + lam * v
    return nd * u / max(u.norm(), 1e-12)


def _replay(
    codec: BlockCodec | str | None = None,
    budget: float | None = None,
    keep: float | None = None,
    normalized: bool = False,
) -> tuple[list[torch.Tensor], list[tuple]]:
    """One process: the three workers' phases in the order of their modelled send times (ties
    together, in rank order), the syncer's merges by hand (samples-weighted mean, Delayed
    Nesterov with N = 2), the last step a meeting; with `codec`, each contribution (the flat
    buffer: the parameters end to end) quantised with error feedback (`"bfloat16"`: each piece
    a 16-bit copy, nothing fed back); with `budget`, phases by
    modelled time; with `keep`, each contribution corrected by HeLoCo (`_heloco`) against the
    momentum before its merge; `normalized`: each change weighed by the merge's most samples
    (FedNova's normalized averaging) instead of its own. Returns the final model and each
    merge's (time, contributions)."""
    models = [_model() for _ in SPEEDS]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    theta = [p.detach().clone() for p in models[0].parameters()]
    momentum = [torch.zeros_like(t) for t in theta]
    buffered = [torch.zeros_like(t) for t in theta]
    anchors = [[t.clone() for t in theta] for _ in SPEEDS]
    base = [0] * len(SPEEDS)
    residuals = [torch.zeros(sum(t.numel() for t in theta)) for _ in SPEEDS]
    version, cycle, pending, log = 0, 0, [], []

    def merge(at: float) -> None:
        nonlocal version, cycle
        if keep is not None:
            pending[:] = [
                (r, n, [_heloco(d, m, keep) for d, m in zip(g, momentum, strict=True)])
                for r, n, g in pending
            ]
        total, most = sum(n for _, n, _ in pending), max(n for _, n, _ in pending)
        # per contribution: a worker may have two in one merge (a send still pending, and
        # its meeting's)
        weights = [(most if normalized else n) / total for _, n, _ in pending]
        mean = [sum(g[i] * w for (_, _, g), w in zip(pending, weights, strict=True))
                for i in range(len(theta))]  # fmt: skip
        k = len(pending)  # a merge of k contributions counts k of the cycle's DELAY
        cycle += k
        plain = k / max(DELAY, k)
        for t, g, m, b in zip(theta, mean, momentum, buffered, strict=True):
            b += k * g
            if cycle >= DELAY:
                m.mul_(0.9).add_(b / cycle)
                t -= 0.7 * (plain * g + 0.9 * m)
                b.zero_()
            else:
                t -= 0.7 * plain * g
        cycle = 0 if cycle >= DELAY else cycle
        log.append((at, k))
        pending.clear()
        version += 1

    # worker r computes a tick where its next step ends by it (the modelled clock), and sends
    # after its first step and every PERIOD of its own steps; the last tick is a meeting
    # (with `budget`: after its first step, then whenever its next step would not fit in
    # `budget` modelled seconds: DyLU)
    events, todo = [], [[] for _ in SPEEDS]
    for r, speed in enumerate(SPEEDS):
        done, phase = 0, 0.0
        for tick in range(STEPS):
            if (done + 1) * speed <= tick + 1:
                done += 1
                phase += speed
                todo[r].append(tick)
                ends = done == 1 or (phase + speed > budget if budget else (done - 1) % PERIOD == 0)
                if ends and tick != STEPS - 1:
                    events.append((done * speed, r, tick))
                    phase = 0.0
            if tick == STEPS - 1:
                events.append((done * speed, r, tick))
    events.sort()  # by time, ties in rank order
    trained = [0] * len(SPEEDS)
    for at, group in groupby(events, key=lambda e: e[0]):
        group = list(group)
        meets = []
        for _, r, step in group:
            ticks = [t for t in todo[r] if trained[r] <= t <= step]
            for t in ticks:
                _inner_step(models[r], opts[r], r, t)
            samples = BATCH * len(ticks)
            trained[r] = step + 1
            local = [p.detach() for p in models[r].parameters()]
            change = [a - p for a, p in zip(anchors[r], local, strict=True)]
            if codec == "bfloat16":  # a 16-bit copy of each piece, nothing fed back
                change = [c.to(torch.bfloat16).to(torch.float32) for c in change]
            elif codec is not None:  # the flat buffer through the codec, its error fed back
                flat = torch.cat([c.reshape(-1) for c in change]) + residuals[r]
                sent = codec.dequantize(codec.quantize(flat), flat.numel())
                residuals[r] = flat - sent
                change = [c.reshape(t.shape) for c, t in zip(
                    sent.split([t.numel() for t in theta]), theta, strict=True)]  # fmt: skip
            pending.append((r, samples, change))
            if step == STEPS - 1:
                meets.append(r)
        if len({r for r, _, _ in pending}) >= QUORUM:
            merge(at)
        for _, r, _step in group:
            if r in meets:
                continue
            if base[r] != version:
                anchors[r] = [t.clone() for t in theta]
                base[r] = version
            with torch.no_grad():
                for p, a in zip(models[r].parameters(), anchors[r], strict=True):
                    p.copy_(a)
    if pending:  # the meeting merges what is left
        merge(events[-1][0])
    return theta, log


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", ["float32", "int8", "bfloat16", "time budget", "normalized", "heloco"]
)
def test_a_run_on_modelled_clocks_equals_the_one_process_replay_of_its_order(variant):
    codec = {"int8": BlockCodec("int8"), "bfloat16": "bfloat16"}.get(variant)
    # DyLU: 4, 2 and 1 steps a phase; normalized: merges of those weigh each change alike
    budget = 4.0 if variant in ("time budget", "normalized") else None
    normalized = variant == "normalized"
    # a high threshold, so that this small regression's aligned blocks are corrected too
    keep = 0.95 if variant == "heloco" else None
    kwargs = {"comm_dtype": "int8", "error_feedback": True} if variant == "int8" else {}
    if variant == "bfloat16":  # rank 0's own contribution as the syncer decodes the others'
        kwargs["comm_dtype"] = torch.bfloat16
    if budget is not None:
        kwargs["inner_time_s"] = budget
    if normalized:
        kwargs["normalized_merges"] = True
    if keep is not None:
        kwargs["correction"] = HeLoCo(keep=keep)
    results = run_distributed(_async_worker, 3, kwargs, timeout_s=90)
    expected, log = _replay(codec, budget, keep, normalized)
    for out, _, _ in results:  # every worker ends on the final global model
        for got, want in zip(out, expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    events = results[0][2]
    assert [(e["time"], e["contributions"]) for e in events] == log
    assert max(e["max_staleness"] for e in events) >= 1  # stale contributions were merged
    assert any(e["contributions"] >= 2 for e in events)  # a tie between two workers
    assert results[0][1]["async_merges"] == len(log)
    if keep is not None:  # the correction acted: without it the models differ (tested below)
        assert results[0][1]["async_corrected_blocks"]["reoriented"] > 0
        plain, _ = _replay(codec, budget)
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(plain, expected, strict=True))
    if normalized:  # merges of unequal samples: the weighted mean would differ
        weighted, _ = _replay(codec, budget)
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(weighted, expected, strict=True))


def _robust_worker(rank: int, world_size: int):
    """One phase of one step, ending in the meeting: worker 1 sends NaN, worker 3 a change
    100x too large; the syncer's median over what is finite. Returns the model, each worker's
    contribution (as sent) and the summary."""
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = AsyncAverager(
        PERIOD, module=model, store=dist.distributed_c10d._get_default_store(), run_id="robust",
        max_steps=1, min_quorum=4, outer_delay=1, step_s=1.0, timeout_s=60,
        aggregate=Aggregate("median"), **OUTER,
    )  # fmt: skip
    start = [p.detach().clone() for p in model.parameters()]
    _inner_step(model, opt, rank, 0)
    with torch.no_grad():
        if rank == 1:
            model.weight[0, 0] = float("nan")
        if rank == 3:
            for p, s in zip(model.parameters(), start, strict=True):
                p.copy_(s + 100 * (p - s))
    sent = [s - p.detach() for p, s in zip(model.parameters(), start, strict=True)]
    averager.trained(BATCH)
    averager.maybe_average()
    return [p.detach().clone() for p in model.parameters()], sent, averager.summary()


@pytest.mark.slow
def test_the_syncer_drops_non_finite_contributions_and_takes_a_robust_rule():
    results = run_distributed(_robust_worker, 4, timeout_s=90)
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    kept = [results[r][1] for r in (0, 2, 3)]
    median = [torch.stack(rows).median(dim=0).values for rows in zip(*kept, strict=True)]
    # the first outer step of torch's Nesterov SGD: momentum buffer = g, step lr (g + 0.9 g)
    expected = [s - 0.7 * (g + 0.9 * g) for s, g in zip(start, median, strict=True)]
    for out, _, _ in results:
        for got, want in zip(out, expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()
    assert results[0][2]["async_dropped_nonfinite"] == [[1, 1.0]]


# --- from the CLI ----------------------------------------------------------------------------

# 4 workers: the synchronous all-reduce sums in gloo's ring order, which a mean formed
# anywhere else would not reproduce to the bit; rounds after steps 3, 7, ..., 23 and
# checkpoints after 8, 16 and 24 steps (meetings, which coincide with rounds)
SAME = FAST + [
    "dist.world_size=4", "trainer.max_steps=24", "sync.warmup_steps=3", "sync.period=4",
    "sync.outer=diloco", "trainer.checkpoint_every=8", "trainer.eval_every=1000",
    "data.num_samples=800", "model.hidden=[16]",
]  # fmt: skip
EQUAL_CLOCKS = ["sync.mode=async", "sync.min_quorum=4", "sync.outer_delay=1",
                "comm.simulate.worker_speed=[1,1,1,1]", "comm.simulate.step_s=0.001"]  # fmt: skip


def same_as_synchronous(tmp_path, args: list[str], workers: int = 4) -> dict:
    """Run `args` synchronously and asynchronously on equal clocks with a full quorum (of
    `workers`) and the synchronous outer step; assert one final model, bit for bit. The
    asynchronous summary."""
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    proc, _ = cli(args + [f"hydra.run.dir={sync_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    clocks = [f"sync.min_quorum={workers}" if c.startswith("sync.min_quorum=") else c
              for c in EQUAL_CLOCKS]  # fmt: skip
    proc, _ = cli(args + clocks + [f"hydra.run.dir={async_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(sync_dir / "model.pt", async_dir / "model.pt")
    return json.loads((async_dir / "summary.json").read_text())


@pytest.mark.slow
def test_equal_clocks_with_a_full_quorum_are_synchronous_diloco_bit_for_bit(tmp_path):
    same_as_synchronous(tmp_path, SAME)


@pytest.mark.slow
def test_equal_clocks_with_phases_by_time_are_the_synchronous_time_budget_bit_for_bit(tmp_path):
    """DyLU's phases (`sync.inner_time_s`) on equal clocks: the first ends after the first
    computed step, as the budget's first round (torch's rule: right after the warmup), then
    every budget, where its rounds run. Before, the first phase ran a whole budget: 5 merges
    against the budget's 6 rounds, and another model."""
    args = [a for a in SAME if not a.startswith("trainer.checkpoint_every")] + [
        "trainer.checkpoint_every=1000", "sync.inner_time_s=0.004",
        "comm.simulate.worker_speed=[1,1,1,1]", "comm.simulate.step_s=0.001",
    ]  # fmt: skip
    runs = {"sync": [], "async": ["sync.mode=async", "sync.min_quorum=4", "sync.outer_delay=1"]}
    for name, extra in runs.items():
        proc, _ = cli(args + extra + [f"hydra.run.dir={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(tmp_path / "sync" / "model.pt", tmp_path / "async" / "model.pt")
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["async_merges"] == 6  # after steps 3, 7, 11, 15, 19 and 23 (the last)
    # what the merges took: every worker's steps after the 3 of the warmup, 32 samples each
    assert summary["async_merged_samples"] == 4 * 21 * 32


@pytest.mark.slow
def test_an_asynchronous_run_resumes_exactly_after_a_kill(tmp_path):
    # checkpoints every 5 steps are meetings; the kill comes after the one at step 10
    # with HeLoCo's correction, which reads the outer momentum the checkpoint carries; the
    # replicas checked where they meet (worker 1 idles the first tick after the warmup: it
    # must not count itself in sync there and check alone)
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "comm.simulate.worker_speed=[1,3]",
                   "comm.simulate.step_s=0.002", "sync.staleness_correction=heloco",
                   "sync.check_replicas=true"]  # fmt: skip
    reference, resumed = killed_and_resumed(args, tmp_path)
    counts = [json.loads((d / "summary.json").read_text())["async_corrected_blocks"]
              for d in (reference, resumed)]  # fmt: skip
    assert counts[0] == counts[1] and counts[0]["shrunk"] + counts[0]["reoriented"] > 0
    assert json.loads((reference / "summary.json").read_text())["replica_checks"] >= 1
    again = tmp_path / "again"
    proc, _ = cli(args + [f"hydra.run.dir={again}"])  # the same seed: the same model
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_model(again / "model.pt", reference / "model.pt")


@pytest.mark.slow
@pytest.mark.parametrize("grace", ["0", "0.5"])
def test_on_the_wall_clock_the_workers_end_on_one_checked_model(tmp_path, grace):
    """Equally fast workers on the wall clock: with a window wide enough for both to arrive in
    it, their exchanges are synchronous rounds (`synchronous_rounds`: an all-reduce, not each
    contribution through rank 0), each one checked; with none, every one is point-to-point."""
    run_dir = tmp_path / "run"
    args = FAST + ["dist.world_size=2", "trainer.max_steps=30", "sync.period=4",
                   "sync.outer=diloco", "sync.mode=async", "sync.check_replicas=true",
                   "trainer.checkpoint_every=10", "trainer.log_every=10", "logger=jsonl",
                   f"sync.grace_s={grace}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["async_merges"] >= 2 and summary["async_version"] == summary["async_merges"]
    rounds = summary["async_exchanges"]["collective"]
    assert rounds >= 5 if grace != "0" else rounds == 0, summary["async_exchanges"]
    # bit-identical replicas checked at the meetings (steps 10, 20, 30) and at each synchronous
    # round; the replicas' drift logged at the meetings
    assert summary["replica_checks"] > 3 if grace != "0" else summary["replica_checks"] == 3
    drifts = [r["drift"] for r in train_records(run_dir) if "drift" in r]
    assert len(drifts) == 3 and all(d > 0 for d in drifts), drifts


@pytest.mark.slow
@pytest.mark.parametrize(
    "hosted",
    [False, pytest.param(True, marks=pytest.mark.long)],  # ft=torchft: ~5 s more
)
def test_a_simulated_slow_link_slows_the_point_to_point_transfers(tmp_path, hosted):
    """`comm.simulate.latency_ms` slows the syncer's point-to-point transfers as it slows the
    collectives (`links.Slowed`): worker 1's 4 exchanges (no synchronous rounds with
    `sync.grace_s=0`) each send its contribution and take the model back, 0.1 s each at both
    ends, and rank 0 waits for them at the meeting; without the link the run takes ~0.05 s.
    `hosted`: under ft=torchft, through each worker's sessions with the launcher's syncer."""
    run_dir = tmp_path / "run"
    args = FAST + ["dist.world_size=2", "trainer.max_steps=12", "sync.period=4",
                   "sync.outer=diloco", "sync.mode=async", "sync.grace_s=0",
                   "comm.simulate.latency_ms=100", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args + (["ft=torchft"] if hosted else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["async_exchanges"]["collective"] == 0
    assert sum(summary["async_exchanges"].values()) == 4
    assert summary["wall_time_s"] > 0.5, summary["wall_time_s"]


@pytest.mark.slow
def test_a_grace_window_lets_a_slow_sender_wait_for_the_merge_of_everyone(tmp_path):
    # DyLU: phases of 0.2 modelled s, so worker 1 (3x slower) sends after 6 steps (0.18 s),
    # worker 0 after 20 (0.20 s). Without a grace window worker 1's contribution merges alone
    # and worker 0's lands one merge stale; with 0.05 s worker 1 waits for worker 0's, every
    # merge takes both, and nobody is stale
    args = FAST + ["dist.world_size=2", "trainer.max_steps=80", "sync.outer=diloco",
                   "sync.mode=async", "sync.inner_time_s=0.2", "trainer.checkpoint_every=0",
                   "comm.simulate.worker_speed=[1,3]", "comm.simulate.step_s=0.01"]  # fmt: skip
    seen = {}
    for grace in (0, 0.05, "null"):  # null, the default: one step of the slowest, 0.03 s
        run_dir = tmp_path / f"grace{grace}"
        proc, _ = cli(args + [f"sync.grace_s={grace}", f"hydra.run.dir={run_dir}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[grace] = json.loads((run_dir / "summary.json").read_text())
    assert seen[0]["async_max_staleness"] >= 1
    assert seen[0.05]["async_max_staleness"] == 0
    assert seen[0.05]["async_merges"] < seen[0]["async_merges"]  # both at once
    # the adaptive window is as wide as the phases' spread (0.02 s): the same merges, the
    # same model as the wider fixed one
    assert seen["null"]["async_merges"] == seen[0.05]["async_merges"]
    assert same_model(tmp_path / "grace0.05" / "model.pt", tmp_path / "gracenull" / "model.pt")


@pytest.mark.slow
def test_a_merge_waits_only_for_a_worker_due_within_its_window(tmp_path):
    # by steps, worker 1 ten times slower: its phases of 0.4 modelled s end within worker 0's
    # 0.05-s window once in ten of worker 0's phases of 0.04 s. Worker 0 waits for it there
    # only: 7 idle ticks of 48 (a merge that waited out its window each time: 23)
    run_dir = tmp_path / "run"
    args = FAST + ["dist.world_size=2", "trainer.max_steps=48", "sync.outer=diloco",
                   "sync.mode=async", "sync.period=4", "trainer.checkpoint_every=0",
                   "comm.simulate.worker_speed=[1,10]", "comm.simulate.step_s=0.01",
                   "sync.grace_s=0.05", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["computed_steps"], summary["idle_steps"]) == (41, 7)


@pytest.mark.slow
@pytest.mark.parametrize("correction", ["none", "heloco"])
def test_workers_whose_phases_end_at_one_modelled_instant_meet_in_synchronous_rounds(
    tmp_path, correction
):
    # DyLU phases of 0.3 s: worker 0 sends after 20 steps of 0.015 s, worker 1 after 10 of
    # 0.03 s; their clocks' float sums differ in the last bits, the instant is one. HeLoCo
    # corrects each contribution, which an all-reduce would not show it: point-to-point then.
    # The weighted merge: the normalized one of unequal samples is the syncer's own (below)
    run_dir = tmp_path / "run"
    args = FAST + ["dist.world_size=2", "trainer.max_steps=60", "sync.outer=diloco",
                   "sync.mode=async", "sync.inner_time_s=0.3", "trainer.checkpoint_every=0",
                   "sync.budget_merge=weighted",
                   "comm.simulate.worker_speed=[1,2]", "comm.simulate.step_s=0.015",
                   f"sync.staleness_correction={correction}",
                   f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["async_max_staleness"] == 0
    exchanges = summary["async_exchanges"]
    if correction == "none":  # but the first phase, one step long: the two end apart
        assert exchanges["p2p"] == 1
        assert exchanges["collective"] == summary["async_merges"] - 1 >= 3
    else:
        assert exchanges["collective"] == 0 and exchanges["p2p"] >= 3


def _summaries(tmp_path, args: list[str], key: str, values: tuple[str, ...]) -> dict:
    """The summary of one CLI run per value of `key` (run dirs named by the value)."""
    out = {}
    for value in values:
        proc, _ = cli(args + [f"{key}={value}", f"hydra.run.dir={tmp_path / value}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[value] = json.loads((tmp_path / value / "summary.json").read_text())
    return out


@pytest.mark.slow
def test_slowmo_runs_asynchronously_with_its_heavy_ball_momentum_delayed(tmp_path):
    """SlowMo's slow momentum is heavy-ball, not Nesterov: its Delayed Nesterov cycle takes the
    momentum before the cycle's mean (`DelayedNesterov(nesterov=False)`). Before, the syncer
    refused to build it, in a worker, after the launch."""
    run_dir = tmp_path / "run"
    args = FAST + ["dist.world_size=4", "trainer.max_steps=32", "sync=slowmo", "sync.period=4",
                   "sync.mode=async", "comm.simulate.worker_speed=[1,1,1,3]",
                   "comm.simulate.step_s=0.001", "sync.check_replicas=true",
                   f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["async_merges"] > 4 and summary["replica_checks"] >= 1


@pytest.mark.slow
def test_sync_budget_merge_reaches_the_syncer(tmp_path):
    """Two workers 2x slower with DyLU's phases: each phase's four contributions (two of half
    the samples) arrive at one instant. `weighted` merges them in the synchronous round's
    all-reduce; `normalized`, the default, scales each to the merge's most samples, which the
    all-reduce does not: the syncer merges them itself, and the model differs."""
    args = FAST + ["dist.world_size=4", "trainer.max_steps=24", "sync.warmup_steps=0",
                   "sync.outer=diloco", "sync.mode=async", "sync.inner_time_s=0.008",
                   "comm.simulate.worker_speed=[1,1,2,2]", "comm.simulate.step_s=0.001",
                   "trainer.checkpoint_every=0"]  # fmt: skip
    summaries = _summaries(tmp_path, args, "sync.budget_merge", ("normalized", "weighted"))
    exchanges = {m: s["async_exchanges"] for m, s in summaries.items()}
    # (the first phase, one step long, ends apart for the slow workers: point-to-point)
    assert exchanges["weighted"]["collective"] >= 2 and exchanges["weighted"]["p2p"] == 1
    assert exchanges["normalized"]["collective"] == 0 and exchanges["normalized"]["p2p"] >= 2
    assert not same_model(tmp_path / "normalized" / "model.pt", tmp_path / "weighted" / "model.pt")


@pytest.mark.slow
def test_sigterm_stops_at_the_next_meeting_and_the_same_command_resumes(tmp_path):
    # checkpoints (meetings) after steps 5, 10, 15, 20, 24; SIGTERM reaches the launcher at
    # step 11, after the syncs of 10: the workers stop at the meeting of 15
    args = BASE + ["sync.outer=diloco", "sync.mode=async", "comm.simulate.worker_speed=[1,3]",
                   "comm.simulate.step_s=0.002"]  # fmt: skip
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    proc, _ = cli(args + [f"hydra.run.dir={reference}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, left = cli(args + [f"hydra.run.dir={run_dir}", override("sigterm:0:11")])
    assert proc.returncode == 143 and not left, proc.stderr[-3000:]
    assert "stopped after step 15 with a checkpoint" in proc.stderr, proc.stderr[-3000:]
    proc, _ = cli(args + [f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0 and "step-15" in proc.stderr, proc.stderr[-3000:]
    assert same_model(run_dir / "model.pt", reference / "model.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["sync.fragments=1"],
        ["sync.fragments=2"],  # the meeting that checkpoints synced every fragment
        ["sync.schedule=adaptive"],  # the syncer's rule goes on at the new workers' count
        ["sync.levels=[{group_size:2,period:2},{group_size:world,period:4}]"],
        ["sync.overlap=true"],  # checkpoints at meetings, where nothing is in flight
    ],
    ids=["whole", "fragments", "adaptive", "levels", "in_flight"],
)
def test_an_asynchronous_checkpoint_resumes_at_another_world_size(tmp_path, extra):
    run_dir = tmp_path / "run"
    args = FAST + ["sync.period=4", "sync.outer=diloco", "sync.mode=async", *extra,
                   "trainer.checkpoint_every=10", "sync.check_replicas=true",
                   "comm.simulate.step_s=0.002", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc, _ = cli(args + ["dist.world_size=2", "trainer.max_steps=20",
                          "comm.simulate.worker_speed=[1,3]"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((run_dir / "summary.json").read_text())
    proc, _ = cli(args + ["dist.world_size=4", "trainer.max_steps=30",
                          "comm.simulate.worker_speed=[1,3,1,1]"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming at another world size" in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["replica_checks"] >= 1
    # the syncer went on from its checkpointed global model's version
    assert summary["async_version"] > first["async_version"] > 0


@pytest.mark.parametrize(
    "args, names",
    [
        (["sync.mode=async", "sync.min_quorum=5", "dist.world_size=4"], "sync.min_quorum"),
        (["sync.mode=async", "sync.outer_delay=0"], "sync.outer_delay"),
        (["sync.mode=asynchronous"], "sync.mode"),
        (["sync.mode=async", "sync.staleness_correction=helo"], "sync.staleness_correction"),
        (["sync.mode=async", "sync.heloco.shrink_cap=2"], "shrink_cap must be in [0, 1], got 2"),
    ],
)
def test_bad_asynchronous_keys_are_one_line(args, names, capsys):
    assert names in refusal(FAST + args, capsys)


def test_a_contribution_older_than_max_staleness_merges_is_not_merged():
    """`sync.max_staleness=1`: a contribution trained from a global model two merges old is
    dropped from its merge (recorded, its samples not counted), the fresh one beside it is
    merged; a merge of nothing but stale ones does not step. The outer step is plain SGD at
    lr 1, so the global model is minus the sum of what was merged."""
    from localsgd.averaging.asynchronous.hosted import build_syncer
    from localsgd.averaging.asynchronous.syncer import Arrival

    spec = {
        "buffers": [[4, "float32"]], "parts": [[[0, 0, 4, 4]]], "blocks": [[0, 0, 4]],
        "sgd": {"lr": 1.0, "momentum": 0.0, "nesterov": False, "warmup_rounds": 0},
        "plain_first": False, "wire": {"dtype": "float32"}, "aggregate": None,
        "correction": None, "normalized": False, "max_staleness": 1,
    }  # fmt: skip
    syncer, _ = build_syncer({"spec": spec}, lambda t: t.zero_())
    ones = torch.ones(4)
    for worker, version, change in ((0, 0, 1.0), (1, 1, 2.0)):  # fresh: versions 1, 2
        syncer.add(Arrival(worker, float(version), 10, version, [ones * change]))
        assert syncer.merge()
    syncer.add(Arrival(2, 3.0, 10, 0, [ones * 100]))  # two merges old
    syncer.add(Arrival(0, 3.0, 10, 2, [ones]))
    assert syncer.merge()
    assert torch.equal(syncer.values[0], -4 * ones)
    assert syncer.too_stale == [(2, 3.0, 2)] and syncer.version == 3
    syncer.add(Arrival(1, 4.0, 10, 1, [ones * 100]))
    assert not syncer.merge() and syncer.version == 3
    assert syncer.merged_samples == 30 and syncer.staleness == [0, 0, 0]
    assert syncer.too_stale == [(2, 3.0, 2), (1, 4.0, 2)]
    resumed, _ = build_syncer({"spec": spec}, lambda t: t.zero_())  # the list is checkpointed
    resumed.load_state_dict(syncer.state_dict())
    assert resumed.too_stale == syncer.too_stale
    # under a robust rule the stale one is left out of the rows it judges: the median of the
    # three fresh ones, not of four
    robust = {**spec, "aggregate": {"rule": "median"}}
    median, _ = build_syncer({"spec": robust}, lambda t: t.zero_())
    median.versions = [3]
    for worker, change in ((0, 1.0), (1, 2.0), (2, 6.0)):
        median.add(Arrival(worker, 5.0, 10, 3, [ones * change]))
    median.add(Arrival(3, 5.0, 10, 1, [ones * -50]))
    assert median.merge() and torch.equal(median.values[0], -2 * ones)
    assert median.too_stale == [(3, 5.0, 2)]
    spec["max_staleness"] = None  # every one merged
    syncer, _ = build_syncer({"spec": spec}, lambda t: t.zero_())
    syncer.versions = [2]
    syncer.add(Arrival(2, 3.0, 10, 0, [ones]))
    assert syncer.merge() and syncer.too_stale == [] and syncer.staleness == [2]


@pytest.mark.slow
def test_sync_max_staleness_reaches_the_syncer(tmp_path):
    """A worker 3x slower by steps sends contributions one merge old or more: with
    `sync.max_staleness=0` none of them is merged, and the summary names each."""
    args = FAST + ["dist.world_size=2", "trainer.max_steps=24", "sync.warmup_steps=0",
                   "sync.outer=diloco", "sync.mode=async", "sync.period=4",
                   "comm.simulate.worker_speed=[1,3]", "comm.simulate.step_s=0.001",
                   "trainer.checkpoint_every=0"]  # fmt: skip
    seen = _summaries(tmp_path, args, "sync.max_staleness", ("null", "0"))
    assert seen["null"]["async_max_staleness"] >= 1 and seen["null"]["async_dropped_stale"] == []
    dropped = seen["0"]["async_dropped_stale"]
    assert seen["0"]["async_max_staleness"] == 0 and dropped
    assert {worker for worker, _, staleness in dropped} == {1} and min(s for *_, s in dropped) == 1


def test_a_syncer_resumed_under_another_n_keeps_its_own_n_and_the_momentum():
    """`sync.outer_delay=null` makes N the number of workers, so a checkpoint resumed at another
    world size brings Delayed Nesterov's state to another N, or to torch's SGD (N = 1), or the
    other way round: the resumed syncer keeps this run's N and the momentum."""
    from localsgd.averaging.asynchronous.hosted import build_syncer
    from localsgd.averaging.asynchronous.syncer import Arrival

    def syncer(delay):
        spec = {
            "buffers": [[4, "float32"]], "parts": [[[0, 0, 4, 4]]], "blocks": [[0, 0, 4]],
            "sgd": {"lr": 0.5, "momentum": 0.9, "nesterov": True, "warmup_rounds": 0,
                    **({} if delay is None else {"delay": delay})},
            "plain_first": False, "wire": {"dtype": "float32"}, "aggregate": None,
            "correction": None, "normalized": False, "max_staleness": None,
        }  # fmt: skip
        return build_syncer({"spec": spec}, lambda t: t.zero_())[0]

    def momentum(s):
        opt = s.outer.optimizers[0]
        return opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]

    four = syncer(4)
    for worker in range(5):  # a cycle of 4 moved the momentum; one more is pending
        four.add(Arrival(worker % 4, float(worker), 10, four.version, [torch.ones(4) * worker]))
        assert four.merge()
    for delay in (2, None):  # Delayed Nesterov at N = 2, torch's SGD at N = 1
        resumed = syncer(delay)
        resumed.load_state_dict(four.state_dict())
        assert torch.equal(momentum(resumed), momentum(four))
        group = resumed.outer.optimizers[0].param_groups[0]
        assert group.get("delay") == delay  # this run's N, not the checkpoint's 4
        assert ("weight_decay" in group) == (delay is None)  # torch's SGD's own group
    sgd = syncer(None)
    sgd.load_state_dict(four.state_dict())
    back = syncer(4)  # and from torch's SGD back to Delayed Nesterov: the momentum goes on
    back.load_state_dict(sgd.state_dict())
    back.add(Arrival(0, 9.0, 10, back.version, [torch.ones(4)]))
    # 1 of the cycle's 4: the momentum moves at the cycle's end, not here
    assert back.merge() and torch.equal(momentum(back), momentum(four))

"""Robust aggregates and scoring over Streaming DiLoCo's fragments (a gathered combine stage per
fragment, localsgd.averaging.rounds.combine.Gathered; docs/reliability.md, "Workers you cannot
trust"): each fragment's median or trimmed mean equals a one-process reference
(Aggregate.combine, then the fragment's outer SGD) to the last bit on every rank, a NaN fragment
contribution reaches no replica, one verdict state serves every fragment, the model a judge
evaluates is the same on every rank and the other fragments' local values come back exactly,
the mean keeps the all-reduced rounds, and what does not compose is refused in one line. The
CLI run is `long` (`make test-long`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from localsgd.averaging import StreamingAverager
from localsgd.averaging.trust.robust import Aggregate
from localsgd.averaging.trust.trusted_round import Judge
from localsgd.cli.checks import validate
from localsgd.config import ConfigError
from tests.helpers import FAST, cli, compose_config, run_distributed, same_model

WORLD = 4
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}


def _net() -> nn.Module:
    torch.manual_seed(0)  # 4 blocks: fragment 0 takes blocks 0 and 2, fragment 1 blocks 1 and 3
    return nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))


def _train(model, gen, scale=1.0):  # a local step's change
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01 * scale)


def _region(avg, p):
    ((g, s, _, e),) = avg.rounds.parts[p]  # one flat buffer: one piece per fragment
    return g, s, e


def _rounds(rank, rule, comm_dtype="float32", error_feedback=False):
    """4 fragment syncs (fragments 0, 1, 0, 1; H=2, P=2) of the median or trimmed mean; rank 1's
    fragment-1 pseudo-gradient holds NaN at the second. What each rank held before each sync,
    and after it."""
    model = _net()
    avg = StreamingAverager(
        2,
        module=model,
        fragments=2,
        aggregate=Aggregate(rule),
        comm_dtype=comm_dtype,
        error_feedback=error_feedback,
        **OUTER,
    )
    gen = torch.Generator().manual_seed(100 + rank)
    out = {"before": [], "after": [], "anchor0": avg.rounds.anchors.first[0].clone()}
    for step in range(4):
        _train(model, gen, scale=1.0 + rank)
        if rank == 1 and step == 1:
            with torch.no_grad():
                model[1].weight.view(-1)[2] = float("nan")  # block 1: fragment 1
        out["before"].append(avg.flat.buffers[0].clone())
        avg.maybe_average()
        out["after"].append(avg.flat.buffers[0].clone())
    out["events"] = list(avg.rounds.trust.events)
    out["regions"] = [_region(avg, p) for p in range(2)]
    out["anchor"] = avg.rounds.anchors.first[0].clone()
    out["bytes"] = avg.stats.bytes
    # error feedback: no residual carries a dropped NaN into later rounds
    out["residuals_finite"] = all(
        torch.isfinite(r).all() for rs in avg.rounds.residuals for r in rs if r is not None
    )
    return out


def _scored(rank, split, exclude_after=2, bad_from=0):
    """Scoring over fragments: rank 3 moves away from the all-ones model (10x) from step
    `bad_from` on, the others towards it; the loss is the distance to it. What every call of the
    judge's loss saw, the verdicts, and whether the unsynced fragment's local values came back
    exactly."""
    model = _net()
    seen = []

    def loss_at(round_):
        with torch.no_grad():
            value = float(sum((p - 1.0).square().sum() for p in model.parameters()))
        seen.append(value)
        return value

    judge = Judge(loss_at, exclude_after=exclude_after, score_fraction=0.5, split_evaluation=split)
    avg = StreamingAverager(
        2,
        module=model,
        fragments=2,
        aggregate=Aggregate("mean"),
        judge=judge,
        outer_lr=1.0,
        outer_momentum=0.0,
        outer_nesterov=False,
    )
    kept_exactly = []
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                bad = rank == 3 and step >= bad_from
                p.add_((1.0 - p) * 0.1 * (-10.0 if bad else 1.0 + 0.1 * rank))
        g, s, e = _region(avg, 1 - step % 2)  # the fragment that does not sync now
        other = avg.flat.buffers[g][s:e].clone()
        avg.maybe_average()
        kept_exactly.append(torch.equal(avg.flat.buffers[g][s:e], other))
    again = StreamingAverager(
        2, module=_net(), fragments=2, aggregate=Aggregate("mean"), judge=judge
    )
    again.load_state_dict(avg.state_dict())
    trust = avg.rounds.trust
    return {
        "seen": seen,
        "excluded": dict(trust.excluded),
        "events": list(trust.events),
        "anchor": avg.rounds.anchors.first[0].clone(),
        "kept_exactly": kept_exactly,
        "reloaded": again.rounds.trust.state_dict() == trust.state_dict(),
    }


def _worker(rank, world_size):
    torch.set_num_threads(1)
    out = {rule: _rounds(rank, rule) for rule in ("median", "trimmed_mean")}
    out["int8"] = _rounds(rank, "median", comm_dtype="int8", error_feedback=True)
    out["scored"] = _scored(rank, split=False)
    out["scored_split"] = _scored(rank, split=True)
    out["scored_late"] = _scored(rank, split=False, exclude_after=3, bad_from=2)
    return out


def _reference(got: list[dict], rule: str) -> list[torch.Tensor]:
    """One process: each sync's pseudo-gradients (anchor - local, stacked in rank order), the
    non-finite rows left out, `Aggregate.combine`, then the fragment's own outer SGD (Nesterov,
    lr 0.7, momentum 0.9) over its anchor; the model after each sync as rank 0 holds it."""
    anchor = got[0]["anchor0"].clone()
    regions = got[0]["regions"]
    views, optimizers = [], []
    for _, s, e in regions:
        view = anchor[s:e]
        views.append(view)
        optimizers.append(torch.optim.SGD([view], lr=0.7, momentum=0.9, nesterov=True))
    after = []
    for step in range(4):
        p = step % 2
        _, s, e = regions[p]
        rows = torch.stack([anchor[s:e] - r["before"][step][s:e] for r in got])
        keep = [i for i in range(len(got)) if torch.isfinite(rows[i]).all()]
        views[p].grad = Aggregate(rule).combine([rows], keep)[0]
        optimizers[p].step()
        model = got[0]["before"][step].clone()
        model[s:e] = anchor[s:e]
        after.append(model)
    return after


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_robust_fragments_across_processes():
    results = run_distributed(_worker, WORLD)
    for rule in ("median", "trimmed_mean"):
        got = [r[rule] for r in results]
        expected = _reference(got, rule)
        for step in range(4):
            _, s, e = got[0]["regions"][step % 2]
            for r in got:  # every rank: the synced fragment is the reference's, to the bit
                assert torch.isfinite(r["after"][step]).all(), (rule, step)
                assert torch.equal(r["after"][step][s:e], expected[step][s:e]), (rule, step)
                assert torch.equal(r["anchor"], got[0]["anchor"])
        # the NaN of rank 1's fragment 1 at the second sync: dropped, named, on every rank
        assert all(
            r["events"] == [{"round": 1, "step": 1, "rank": 1, "why": "nonfinite"}] for r in got
        )
        # the all-gather counted as what this rank sends: each fragment once a sync, fp32
        assert got[0]["bytes"] == 4 * got[0]["anchor"].numel() * 2
    low = [r["int8"] for r in results]  # through the int8 wire: decoded, then the median
    for step in range(4):
        _, s, e = low[0]["regions"][step % 2]
        for x in low:
            assert torch.isfinite(x["after"][step]).all()
            assert torch.equal(x["after"][step][s:e], low[0]["after"][step][s:e])
            assert torch.equal(x["anchor"], low[0]["anchor"])
    assert low[0]["events"] == [{"round": 1, "step": 1, "rank": 1, "why": "nonfinite"}]
    assert all(x["residuals_finite"] for x in low)
    for key in ("scored", "scored_split"):
        scored = [r[key] for r in results]
        # worker 3 is bad at round 0 (fragment 0) and round 1 (fragment 1): one streak across
        # fragments excludes it at round 1, from every fragment's later rounds
        assert scored[0]["excluded"] == {3: 1}, scored[0]["events"]
        assert all(x["excluded"] == {3: 1} and x["events"] == scored[0]["events"] for x in scored)
        assert all(torch.equal(x["anchor"], scored[0]["anchor"]) for x in scored)
        assert all(all(x["kept_exactly"]) for x in scored)
        assert all(x["reloaded"] for x in scored)
    # bad from its second round of each fragment (rounds 2 and 3), while its first rounds were
    # honest: probation counts each fragment's first 3 rounds (6 fragment rounds), so 2 bad
    # rounds running exclude it at round 3, not exclude_after=3 of them
    late = [r["scored_late"] for r in results]
    assert all(x["excluded"] == {3: 3} for x in late), late[0]["events"]
    # every rank evaluating everything saw the same losses: the model judged is the same on
    # every rank (the other fragment at its anchor), though the local models differ
    seen = [r["scored"]["seen"] for r in results]
    assert all(s == seen[0] for s in seen) and len(seen[0]) > 8


def test_the_mean_keeps_todays_rounds_and_robust_rules_build_gathered_fragment_rounds():
    import torch.distributed as dist

    from localsgd.averaging import CommStats
    from localsgd.loop.strategies import build_averager

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        streaming = [
            "sync=streaming_diloco",
            "sync.delay_steps=0",
            "sync.merge_alpha=0",
            "model=mlp",
            "model.hidden=[8,8,8]",
        ]
        for extra, trusted in (
            ([], False),
            (["sync.aggregate=median"], True),
            (["sync.aggregate=mean", "sync.score=true"], True),
        ):
            cfg = compose_config([*streaming, *extra])
            validate(cfg, 4)
            model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            avg = build_averager(
                cfg.sync, model, opt, 1, 1, CommStats(), loss_at=lambda round_: 0.0
            )
            assert avg.rounds.gathered is trusted
            assert len(avg.rounds.parts) == cfg.sync.fragments
    finally:
        dist.destroy_process_group()


def test_what_does_not_compose_is_refused_in_one_line():
    streaming = [
        "sync=streaming_diloco",
        "sync.aggregate=median",
        "model=mlp",
        "model.hidden=[8,8,8]",
    ]
    blocking = [*streaming, "sync.delay_steps=0", "sync.merge_alpha=0"]
    for overrides, key in (
        ([*blocking, "sync.eager=true"], "sync.eager=true"),
        (["sync=hierarchical", "sync.outer=diloco", "sync.aggregate=median"], "sync.levels"),
        # the scored mean: the warmup's gradients would go unjudged (a robust rule takes them)
        (
            [*blocking, "sync.aggregate=mean", "sync.score=true", "sync.warmup_steps=4"],
            "sync.warmup_steps",
        ),
    ):
        with pytest.raises(ConfigError, match=key) as info:
            validate(compose_config(overrides), 4)
        assert "\n" not in str(info.value)
    # what composes now: delayed rounds (the gather launched, judged at the merge), mixed and
    # progress merges, plain streaming (the change since each fragment's sync), torchft
    for overrides in (
        streaming,
        [*streaming, "sync.delay_steps=0"],
        [*blocking, "sync.merge_rule=progress", "sync.delay_steps=1"],
        [*blocking, "sync.overlap=true"],
        [*blocking, "sync.outer=none"],
        [*blocking, "ft=torchft"],
        [*blocking, "sync.score=true", "sync.comm_dtype=int4", "sync.error_feedback=true"],
    ):
        validate(compose_config(overrides), 4)
    # an eager round steps before any aggregate exists: the averager refuses it too
    with pytest.raises(ValueError, match="eager=False"):
        StreamingAverager(2, module=_net(), fragments=2, eager=True, aggregate=Aggregate("median"))


class _Alone:
    """A one-rank group: the gather returns what this rank sent."""

    size, rank = 1, 0

    def all_gather_(self, out, inp):
        out.copy_(inp)


def test_gathered_rounds_decay_the_residual_as_the_mean_does():
    """`sync.error_feedback_decay` (beta) under a gathered sync: `beta * residual` is added
    before the contribution is rounded, as `lossy_mean_` does (it was added whole)."""
    from localsgd.averaging.trust.robust import GatheredContributions

    flat = torch.linspace(-1, 1, 33)
    residual = torch.full((33,), 0.3)
    low = torch.empty(33, dtype=torch.bfloat16)
    rows = GatheredContributions([flat], 1, [low], decay=0.5).gather_(
        [flat.clone()], _Alone(), [residual]
    )
    wanted = flat + 0.5 * 0.3
    assert torch.equal(rows[0][0], wanted.bfloat16().float())
    assert torch.equal(residual, wanted - wanted.bfloat16().float())


# Streaming DiLoCo, blocking and replacing, 2 fragments: a fragment sync every 5 steps
STREAMING = [
    *FAST,
    "dist.world_size=4",
    "sync=streaming_diloco",
    "sync.period=10",
    "sync.fragments=2",
    "sync.delay_steps=0",
    "sync.merge_alpha=0",
    "model.hidden=[32,32,32]",
    "optim=adamw",
    "optim.lr=0.003",
    "sync.aggregate=median",
]


def _attack(kind: str, rank: int = 1) -> str:
    attack = f"{{_target_:localsgd.loop.attacks.Attack,kind:'{kind}',rank:{rank}}}"
    return f"trainer.callbacks=[{attack}]"


@pytest.mark.slow
@pytest.mark.long  # two CLI runs of 4 workers: `make test-long`
@pytest.mark.timeout(240)
def test_cli_streaming_diloco_with_a_robust_aggregate_drops_and_excludes(tmp_path):
    """From the command line, Streaming DiLoCo (2 fragments, blocking, α = 0) under the median:
    a NaN attacker's fragment contributions are dropped at every fragment sync and the run
    trains on, naming worker 1; scored, a sign-flipping attacker is excluded at its second bad
    fragment round (on probation: `sync.probation_rounds`) and named in the log, the metrics
    and the summary."""
    common = [
        *STREAMING,
        "trainer.max_steps=40",
        "trainer.log_every=10",
        "sync.check_replicas=true",  # replicas compared bit for bit after every sync
        # the rounds below are this data's: with the default validation split the held-out
        # batches differ and the attacker is judged bad at rounds 2, 4 and 5 (excluded at 5)
        "data.val_fraction=0",
    ]
    runs = {
        "nan": [*common, _attack("nan")],
        "scored": [*common, "sync.score=true", _attack("sign_flip")],
    }
    said = {}
    for name, args in runs.items():
        proc, left = cli([*args, f"hydra.run.dir={tmp_path / name}"])
        said[name] = proc.stdout + proc.stderr
        assert not left
        assert proc.returncode == 0, proc.stderr[-2000:]
    nan = json.loads((tmp_path / "nan" / "summary.json").read_text())
    # fragment syncs after steps 0, 5, ..., 35 (rounds 0-7); the final blocking average
    # follows no optimizer step: no attack
    assert nan["trust"]["dropped_nonfinite"] == [[1, r] for r in range(8)], nan["trust"]
    assert "trust: worker 1 at round 0 (step 0): its contribution held NaN/Inf" in said["nan"]
    assert nan["test_loss"] == nan["test_loss"]  # finite: trained on
    scored = json.loads((tmp_path / "scored" / "summary.json").read_text())
    assert scored["trust"]["excluded"] == {"1": 1}, scored["trust"]
    assert "trust: worker 1 at round 1 (step 5): excluded" in said["scored"]
    lines = [
        json.loads(x) for x in (tmp_path / "scored" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any(line.get("excluded") == {"1": 1} for line in lines)


@pytest.mark.slow
@pytest.mark.long  # three CLI runs of 4 workers: `make test-long`
@pytest.mark.timeout(240)
def test_a_killed_scored_streaming_run_resumes_with_the_same_verdicts(tmp_path):
    """The fragments' verdict state is checkpointed with the averager: killed between fragment
    syncs and resumed, a scored run ends with the bits and the verdicts of an uninterrupted
    one."""
    args = [
        *STREAMING,
        "trainer.max_steps=60",
        "trainer.checkpoint_every=25",
        "sync.score=true",
        "sync.score_batch=32",
        "sync.exclude_after=2",
    ]
    attack = "{_target_:localsgd.loop.attacks.Attack,kind:'zeros',rank:3}"
    kill = "{_target_:tests.faults.Fault,spec:'kill:2:33'}"
    proc, _ = cli([*args, f"trainer.callbacks=[{attack}]", f"hydra.run.dir={tmp_path / 'ref'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = [*args, f"hydra.run.dir={tmp_path / 'run'}"]
    proc, left = cli([*run, f"trainer.callbacks=[{attack},{kill}]"])
    assert proc.returncode == 1 and not left
    proc, _ = cli([*run, f"trainer.callbacks=[{attack}]"])
    assert proc.returncode == 0 and "step-25" in proc.stderr, proc.stderr[-2000:]
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())
    ours = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert ref["trust"]["judged_bad"] and ref["trust"]["excluded"], "no verdict to carry"
    assert ours["trust"] == ref["trust"]
    assert same_model(tmp_path / "run" / "model.pt", tmp_path / "ref" / "model.pt")

"""One worker of 4 three times slower: how much of the straggler-free throughput the others
keep, blocking (every sync waits for it) against a time budget (`sync.inner_time_s`: it
computes fewer of a round's steps, the average weighs each worker by its samples), and the
loss each merge of a budget's round gives.

Each run is `python -m localsgd.train` on MNIST-1D (4 CPU workers, the MLP, no warmup) with
the deterministic slow-worker model: worker r's step lasts `comm.simulate.worker_speed[r]` x
`comm.simulate.step_s` seconds of wall clock (slept out past its compute), so the runs repeat
on a busy machine. Per seed and strategy, side by side in this one process:

- `free`: worker_speed [1, 1, 1, 1] (every step padded to step_s alike);
- `blocking`: [1, 1, 1, 3] (`--slow`);
- `budget`: [1, 1, 1, 3] with sync.inner_time_s = H x step_s (a round's steps at speed 1) and
  the default `sync.budget_merge=normalized` (each worker's change scaled to the round's most
  samples before the samples-weighted mean);
- `budget, weighted`: the same with `sync.budget_merge=weighted` (the changes as they are);
- `blocking, same time`: [1, 1, 1, 3] for a third of the steps (the budget run's wall time; a
  1/max(slow) share in general);
- `free, same samples`: [1, 1, 1, 1] for the steps at which the fleet has trained on the samples
  the budget run merged (its `contributed_samples`): what is left of the budget run's loss gap
  once the slow worker's missing compute is discounted is the merge's own cost;
- `async`: [1, 1, 1, 3] with `sync.mode=async` and its defaults (a syncer on rank 0 merging by
  samples once `sync.min_quorum` = 1 contribution waits; DiLoCo's outer step is Delayed Nesterov
  with N = 4, local SGD's the plain average `sync.outer=none`): under the modelled clock every
  worker covers the same modelled time and a slower one computes only the ticks its step fits,
  so the fleet trains fewer samples than `free` in the same steps;
- `async, DyLU`: the same, each worker's phase ending by time (`sync.inner_time_s` = H x
  step_s, Async Local-SGD's DyLU: the slow worker sends after H/3 of its own steps);
- `async, DyLU, grace`: with `sync.grace_s` one step of the slowest worker, so that each
  phase's contributions (the slow worker's ends up to a step before the others') make one
  merge; `..., weighted`: with `sync.budget_merge=weighted` (the merge before normalized
  merges were the default);
- `async, quorum 2|3`, `async, delay 1|2`, `async, DyLU, delay 1|2`: the same with
  `sync.min_quorum` 2 or 3, or `sync.outer_delay` 1 (the synchronous outer step) or 2, named
  only (the probes of a loss gap);
- `free, same samples as async`: [1, 1, 1, 1] for the steps at which the fleet has trained on
  the samples an async run trained and merged (every contribution is merged at the last step's
  meeting; counted from the modelled clock's rule, `clock.computes`, which the trainer reads):
  the loss at equal samples. The async conditions' `vs blocking at the same wall time` is
  against `blocking, same time` as the budget's: both cover the steps' modelled time, as `free`.

Throughput is rank 0's (a fast worker's) computed samples over its training seconds (wall time
less the periodic evaluations); the ratio is against `free` of the same seed. Writes
experiments/stragglers/OUT.{md,json} (`--out`, straggler_study by default).

    # as committed, ~12 min:
    python experiments/stragglers/straggler_study.py --steps 600 --step-s 0.015
    python experiments/stragglers/straggler_study.py --steps 600 --step-s 0.015 --seeds 3 4 5 \
        --slow 1 1 2 4 --out straggler_study_two_slow     # the setting nothing was chosen on
    python experiments/stragglers/straggler_study.py --setting lm --steps 400 --step-s 0.25 \
        --seeds 0 1 --conditions free budget "budget, weighted" --out straggler_study_lm   # ~15 min
    python experiments/stragglers/straggler_study.py --steps 600 --step-s 0.015 --strategies \
        "Streaming DiLoCo H=48 P=4" --conditions free blocking budget "budget, weighted" \
        --out straggler_study_streaming     # the fragments' weighted rounds, ~5 min
    python experiments/stragglers/straggler_study.py --steps 600 --step-s 0.015 --strategies \
        "Streaming DiLoCo H=48 P=4 tau=1" --conditions free blocking budget "budget, weighted" \
        --out straggler_study_streaming_delayed   # and "... tau=1 fp4": the 4-bit wire
    python experiments/stragglers/straggler_study.py --setting lm --steps 400 --step-s 0.25 \
        --strategies "LM Streaming DiLoCo H=16 P=4" --conditions free budget \
        --out straggler_study_lm_streaming
    # asynchronous rounds beside blocking and the budget (issue 48), ~15 min each:
    python experiments/stragglers/straggler_study.py --steps 600 --step-s 0.015 --conditions \
        free blocking budget async "async, DyLU" "blocking, same time" "free, same samples" \
        "free, same samples as async" --out straggler_study_async
    python experiments/stragglers/straggler_study.py ... --seeds 3 4 5 --slow 1 1 2 2 \
        --out straggler_study_async_two_slow     # the setting nothing was tuned on
    python experiments/stragglers/straggler_study.py --setting lm --steps 400 --step-s 0.25 \
        --conditions free budget async "free, same samples" "free, same samples as async" \
        --out straggler_study_lm_async     # ~30 min
    python experiments/stragglers/straggler_study.py --tiny     # smoke test: 1 seed, a few steps
    # with --paired: how finely the test set resolves each loss at equal samples (paired.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)  # the clock of this checkout, as the runs (cwd ROOT) import it

import paired  # noqa: E402  (beside this script)

from localsgd.averaging.asynchronous.clock import computes  # noqa: E402

STRATEGIES = {  # name: (overrides, H)
    "local SGD H=16": (["sync.period=16"], 16),
    "DiLoCo H=50": (["+experiment=diloco", "sync.outer_warmup_rounds=0"], 50),
    # ... as Streaming DiLoCo with 2 fragments (tau = 0, alpha = 0): asynchronously, each phase
    # of 25 steps sends one
    "DiLoCo H=50 P=2": (
        ["+experiment=diloco", "sync.outer_warmup_rounds=0", "sync.fragments=2"],
        50,
    ),
    # each of 4 fragments weighs the samples since its own sync (blocking: the weighted rounds
    # are the blocking ones)
    "Streaming DiLoCo H=48 P=4": (
        [
            "+experiment=streaming_diloco",
            "sync.delay_steps=0",
            "sync.merge_alpha=0",
            "sync.outer_warmup_rounds=0",
        ],
        48,
    ),  # fmt: skip
    # ... each round a step late, overlapping the next step (the paper's τ = 1; α = 0, as the
    # normalized merge needs): weighted by the samples since the fragment's merge
    "Streaming DiLoCo H=48 P=4 tau=1": (
        [
            "+experiment=streaming_diloco",
            "sync.delay_steps=1",
            "sync.merge_alpha=0",
            "sync.outer_warmup_rounds=0",
        ],
        48,
    ),  # fmt: skip
    # ... on the paper's 4-bit wire with error feedback
    "Streaming DiLoCo H=48 P=4 tau=1 fp4": (
        [
            "+experiment=streaming_diloco",
            "sync.delay_steps=1",
            "sync.merge_alpha=0",
            "sync.outer_warmup_rounds=0",
            "sync.comm_dtype=float4_e2m1",
            "sync.error_feedback=true",
        ],
        48,
    ),  # fmt: skip
}
# --setting lm: the Shakespeare LM of the chaos and trust studies (a 215k-parameter GPT, inner
# AdamW) under DiLoCo with H = 16, a setting the merges were not compared on first
LM = [
    "data=shakespeare", "model=transformer", "model.n_layers=4", "model.n_heads=4",
    "model.d_model=64", "optim=adamw", "optim.lr=0.002", "lr_schedule.warmup_steps=40",
    "trainer.batch_size=16", "trainer.eval_samples=1024", "trainer.eval_batch_size=256",
]  # fmt: skip
SETTINGS = {  # name: (overrides, strategies, batch per worker, what the table says)
    "mnist1d": (["data=mnist1d", "model=mlp"], STRATEGIES, 32, "MNIST-1D"),
    # each worker its own mix of classes (HeLoCo's setting: heterogeneous workers, non-iid data)
    "mnist1d_dirichlet": (
        ["data=mnist1d", "model=mlp", "data.partition=dirichlet", "data.alpha=0.5"],
        STRATEGIES,
        32,
        "MNIST-1D, each worker's classes drawn from Dirichlet(0.5)",
    ),
    # five times the data (8,000 train samples per worker): where the job's own overfits late
    "mnist1d_40k": (
        ["data=mnist1d", "model=mlp", "data.num_samples=40000"],
        STRATEGIES,
        32,
        "MNIST-1D with 40,000 samples (8,000 train samples per worker)",
    ),
    "lm": (
        LM,
        {
            "LM DiLoCo H=16": (["sync=diloco", "sync.period=16", "sync.outer_warmup_rounds=0"], 16),
            "LM Streaming DiLoCo H=16 P=4": (
                [
                    "sync=streaming_diloco",
                    "sync.period=16",
                    "sync.fragments=4",
                    "sync.delay_steps=0",
                    "sync.merge_alpha=0",
                    "sync.outer_warmup_rounds=0",
                ],
                16,
            ),  # fmt: skip
            "LM Streaming DiLoCo H=16 P=4 tau=1": (
                [
                    "sync=streaming_diloco",
                    "sync.period=16",
                    "sync.fragments=4",
                    "sync.delay_steps=1",
                    "sync.merge_alpha=0",
                    "sync.outer_warmup_rounds=0",
                ],
                16,
            ),  # fmt: skip
        },
        16,
        "the Shakespeare LM",
    ),
}
CONDITIONS = (  # in run order: "free, same samples" reads the budget run's samples
    "free",
    "blocking",
    "budget",
    "budget, weighted",
    "async",
    "async, DyLU",
    "async, quorum 2",
    "async, quorum 3",
    "async, delay 1",
    "async, delay 2",
    "async, DyLU, delay 1",
    "async, DyLU, delay 2",
    "async, DyLU, grace",
    "async, DyLU, weighted",
    "async, DyLU, grace, weighted",
    "async, HeLoCo",
    "async, DyLU, HeLoCo",
    "async, HeLoCo keep 0",
    "async, DyLU, HeLoCo keep 0",
    "async, HeLoCo kappa 10",
    "async, DyLU, HeLoCo kappa 10",
    "async, HeLoCo no shrink",
    "async, DyLU, HeLoCo no shrink",
    "blocking, same time",
    "free, same samples",
    "free, same samples as async",
)
DEFAULT_CONDITIONS = [  # the committed study's (the async ones by name)
    "free", "blocking", "budget", "budget, weighted", "blocking, same time", "free, same samples"
]  # fmt: skip
MERGES = {"budget": "normalized", "budget, weighted": "weighted"}
ASYNC = {  # condition: its overrides beside sync.mode=async (DyLU: the phase by time, below)
    "async": [],
    "async, DyLU": [],
    "async, quorum 2": ["sync.min_quorum=2"],
    "async, quorum 3": ["sync.min_quorum=3"],
    "async, delay 1": ["sync.outer_delay=1"],
    "async, delay 2": ["sync.outer_delay=2"],
    "async, DyLU, delay 1": ["sync.outer_delay=1"],
    "async, DyLU, delay 2": ["sync.outer_delay=2"],
    # sync.grace_s: one step of the slowest worker (run_one), so that a DyLU phase's
    # contributions, which end up to a step apart, make one merge
    "async, DyLU, grace": [],
    "async, DyLU, weighted": ["sync.budget_merge=weighted"],  # as before normalized merges
    "async, DyLU, grace, weighted": ["sync.budget_merge=weighted"],
    "async, HeLoCo": ["sync.staleness_correction=heloco"],
    "async, DyLU, HeLoCo": ["sync.staleness_correction=heloco"],
    # probes of HeLoCo's settings: shrink only, a weaker confidence, reorient only
    **{
        f"async, {dylu}HeLoCo {name}": ["sync.staleness_correction=heloco", setting]
        for dylu in ("", "DyLU, ")
        for name, setting in (
            ("keep 0", "sync.heloco.keep=0"),
            ("kappa 10", "sync.heloco.kappa=10"),
            ("no shrink", "sync.heloco.shrink_cap=0"),
        )
    },
}
COMPARED = ("blocking", *MERGES, *ASYNC)  # the table's rows


def speeds(condition: str, slow: list[float]) -> str:
    """`comm.simulate.worker_speed` of a condition: every worker at 1 without a straggler."""
    fleet = [1.0] * len(slow) if condition.startswith("free") else slow
    return "[" + ",".join(f"{s:g}" for s in fleet) + "]"


def run_one(
    strategy: str, condition: str, seed: int, args, run_dir: str, steps: int | None = None
) -> dict:
    base, strategies, batch, _ = SETTINGS[args.setting]
    overrides, period = strategies[strategy]
    budget = []
    if condition in MERGES:
        budget = [
            f"sync.inner_time_s={period * args.step_s}",
            f"sync.budget_merge={MERGES[condition]}",
        ]
    elif condition in ASYNC:
        budget = ["sync.mode=async", *ASYNC[condition], *args.extra]
        if "DyLU" in condition:
            budget.append(f"sync.inner_time_s={period * args.step_s}")
        # (no grace window: 0, the default until the adaptive one; the window of one slow
        # step is what the adaptive default is under the modelled clock)
        grace = max(args.slow) * args.step_s if "grace" in condition else 0
        budget.append(f"sync.grace_s={grace:g}")
    if steps is None:
        same_time = condition == "blocking, same time"
        steps = int(args.steps // max(args.slow)) if same_time else args.steps
    command = [
        sys.executable, "-m", "localsgd.train", *overrides,
        *base, *launch(args), *args.job, "sync.warmup_steps=0",
        f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
        "trainer.progress=false", "trainer.checkpoint_every=0", "logger.plots=false",
        f"comm.simulate.worker_speed={speeds(condition, args.slow)}",
        f"comm.simulate.step_s={args.step_s}",
        *budget, f"seed={seed}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} {condition} seed {seed} failed: {proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    seconds = s["wall_time_s"] - s["eval_seconds"]
    computed = s.get("computed_steps", s["steps"])
    if condition in ASYNC:  # what the fleet trained, every contribution merged at the end
        if "async_merged_samples" in s:  # the syncer's count (since 2026-12-07)
            s["contributed_samples"] = s["async_merged_samples"]
        else:  # the modelled clock's, where nobody waits
            fleet = fleet_steps(s["steps"], args.slow)
            if computed != fleet[0]:
                raise SystemExit(
                    f"{condition}: rank 0 computed {computed} steps, the clock {fleet[0]}"
                )
            s["contributed_samples"] = sum(fleet) * batch
    return {
        "samples_per_s": computed * batch / seconds,  # rank 0's
        "test_loss": s["test_loss"],
        "test_accuracy": s.get("test_accuracy", float("nan")),
        "wall_time_s": s["wall_time_s"],
        "round_weights": s.get("round_weights"),
        "wait_s": s.get("wait_s"),
        "contributed_samples": s.get("contributed_samples"),
        "steps": s["steps"],
        "computed_steps": computed,
        **{k: v for k, v in s.items() if k.startswith("async_")},
    }


def fleet_steps(steps: int, fleet: list[float]) -> list[int]:
    """The steps each worker computes in `steps` ticks of asynchronous rounds (no warmup): the
    modelled clock's rule, `clock.computes`, that the trainer's pacer reads."""
    done = [0] * len(fleet)
    for tick in range(steps):
        for r, speed in enumerate(fleet):
            done[r] += computes(done[r] * speed, tick, speed, 1.0)  # in units of step_s
    return done


def same_samples_steps(budget: dict, steps: int, batch: int, workers: int = 4) -> int:
    """The steps at which the straggler-free fleet has trained on what the budget run merged:
    its loss is the budget run's target once the slow worker's missing compute is discounted."""
    return round(budget["contributed_samples"] / (workers * batch * steps) * steps)


def launch(args) -> list[str]:
    """The workers: one process each, or with `--virtual` as many threads of one process (any
    number: one per `--slow` factor; their samples/s are turns, not a parallel job's)."""
    n = len(args.slow)
    return [f"dist.virtual_workers={n}"] if args.virtual else [f"dist.world_size={n}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--step-s", type=float, default=0.01)
    parser.add_argument(
        "--slow",
        type=float,
        nargs="+",
        default=[1, 1, 1, 3],
        help="the workers' slowdown factors in the straggler runs",
    )
    parser.add_argument(
        "--out", default="straggler_study", help="experiments/stragglers/OUT.{md,json}"
    )
    parser.add_argument("--setting", choices=list(SETTINGS), default="mnist1d")
    parser.add_argument(
        "--conditions", nargs="+", choices=CONDITIONS, default=DEFAULT_CONDITIONS,
        help="these conditions only (free is always run: every ratio is against it)",
    )  # fmt: skip
    parser.add_argument(
        "--strategies", nargs="+", default=None,
        help="these strategies of the setting (default: all but Streaming DiLoCo)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--extra", nargs="*", default=[], metavar="KEY=VALUE",
        help="more overrides for the asynchronous runs (a probe: sync.outer_delay=4)",
    )  # fmt: skip
    parser.add_argument(
        "--job", nargs="*", default=[], metavar="KEY=VALUE",
        help="more overrides for every run (a probe: lr_schedule=constant)",
    )  # fmt: skip
    parser.add_argument(
        "--virtual", action="store_true",
        help="the workers as threads of one process (dist.virtual_workers), one per --slow factor",
    )  # fmt: skip
    parser.add_argument(
        "--paired", action="store_true",
        help="also each loss at equal samples with its paired bootstrap 95%% interval over the "
        "test samples (paired.py)",
    )  # fmt: skip
    args = parser.parse_args()
    if (len(args.slow) != 4 and not args.virtual) or min(args.slow) < 1:
        parser.error(
            f"--slow must give 4 factors >= 1 (one per worker; any number with --virtual), "
            f"got {args.slow}"
        )
    if args.tiny:
        args.seeds, args.steps = [0], 100
    conditions = [c for c in CONDITIONS if c == "free" or c in args.conditions]
    if "free, same samples" in conditions and "budget" not in conditions:
        parser.error("--conditions 'free, same samples' needs budget (it reads its samples)")
    run_async = [c for c in conditions if c in ASYNC]
    if "free, same samples as async" in conditions and not run_async:
        parser.error("--conditions 'free, same samples as async' needs an async condition")
    _, strategies, batch, what = SETTINGS[args.setting]
    if args.strategies is None:  # the committed study's two; the others by name
        args.strategies = [name for name in strategies if "Streaming" not in name]
    if args.strategies:
        unknown = [name for name in args.strategies if name not in strategies]
        if unknown:
            parser.error(f"--strategies must name some of {list(strategies)}, got {unknown}")
        strategies = {name: strategies[name] for name in args.strategies}
    runs: dict = {}
    losses: dict = {}  # (strategy, condition, seed): the final model's test loss per sample
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for strategy in strategies:
                for condition in conditions:
                    name = f"{strategy}-{condition}-{seed}"
                    name = name.replace(" ", "_").replace("=", "").replace(",", "")
                    run_dir = os.path.join(tmp, name)
                    steps = None
                    if condition == "free, same samples":
                        budget = runs[strategy]["budget"][seed]
                        steps = same_samples_steps(budget, args.steps, batch, len(args.slow))
                    elif condition == "free, same samples as async":  # every async one's alike
                        trained = {
                            runs[strategy][c][seed]["contributed_samples"] for c in run_async
                        }
                        if len(trained) != 1:
                            raise SystemExit(f"async conditions trained unlike samples: {trained}")
                        steps = same_samples_steps(
                            runs[strategy][run_async[0]][seed], args.steps, batch, len(args.slow)
                        )
                    r = run_one(strategy, condition, seed, args, run_dir, steps)
                    runs.setdefault(strategy, {}).setdefault(condition, {})[seed] = r
                    if args.paired:
                        losses[strategy, condition, seed] = paired.test_losses(run_dir)
                    print(strategy, condition, seed, json.dumps(r), flush=True)
    rows, intervals = [], []
    for strategy, by_condition in runs.items():
        free = by_condition["free"]
        short = by_condition.get("blocking, same time")
        for condition in COMPARED:
            if condition not in by_condition:
                continue
            got = by_condition[condition]
            matched = by_condition.get(
                "free, same samples as async" if condition in ASYNC else "free, same samples"
            )

            def against(other, got=got):  # the loss against another run of each seed, if run
                if other is None:
                    return []
                return [got[s]["test_loss"] / other[s]["test_loss"] - 1 for s in args.seeds]

            speed = [got[s]["samples_per_s"] / free[s]["samples_per_s"] for s in args.seeds]
            accuracy = [got[s]["test_accuracy"] - free[s]["test_accuracy"] for s in args.seeds]
            trained = [  # the fleet's samples against free's (blocking trains them all)
                (got[s]["contributed_samples"] or 0) / (len(args.slow) * batch * args.steps)
                if condition != "blocking" else 1.0
                for s in args.seeds
            ]  # fmt: skip
            rows.append(
                (strategy, condition, speed, trained, against(free), against(short),
                 against(matched), accuracy)
            )  # fmt: skip
            match = "free, same samples as async" if condition in ASYNC else "free, same samples"
            if args.paired and match in by_condition:  # how finely the test set resolves it
                intervals.append((strategy, condition, [
                    paired.ratio_interval(
                        losses[strategy, match, s], losses[strategy, condition, s]
                    )
                    for s in args.seeds
                ]))  # fmt: skip
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    workers = (
        f"{len(args.slow)} virtual workers (threads of one process: samples/s are turns)"
        if args.virtual
        else "4 CPU workers"
    )
    lines = [
        "# Slow workers: blocking against a time budget"
        + (" and asynchronous rounds" if run_async else ""),
        "",
        f"Run {stamp}, `python experiments/stragglers/straggler_study.py "
        f"{shlex.join(sys.argv[1:])}` "
        f"(seeds {', '.join(map(str, args.seeds))}, {args.steps} steps, step_s {args.step_s} s, "
        f"worker speeds {speeds('blocking', args.slow)}); {what}, {workers}, gloo. "
        "Ratios are against the straggler-free run of the same seed and strategy, measured in "
        "the same invocation.",
        "",
        "| strategy | slow worker | rank 0 samples/s vs free (per seed) | fleet's samples vs free "
        "| final test loss vs free, same steps (per seed) | test accuracy vs free, points | vs "
        "blocking at the same wall time | vs free at the samples the run merged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for strategy, condition, speed, trained, loss, timed, fair, accuracy in rows:
        budget = condition != "blocking"
        lines.append(
            f"| {strategy} | {condition} | {', '.join(f'{x:.3f}' for x in speed)} | "
            f"{', '.join(f'{x:.3f}' for x in trained)} | "
            f"{', '.join(f'{x:+.1%}' for x in loss)} | "
            f"{', '.join(f'{100 * x:+.1f}' for x in accuracy)} | "
            + (", ".join(f"{x:+.1%}" for x in timed) if budget else "")
            + " | "
            + (", ".join(f"{x:+.1%}" for x in fair) if budget else "")
            + " |"
        )
    if intervals:
        lines += [
            "",
            "The loss at equal samples with its paired bootstrap 95% interval over the test "
            "samples (`paired.py`: both models on the same resampled test set; an interval "
            "wider than a target means this test set cannot resolve it):",
            "",
            "| strategy | slow worker | vs free at the samples the run merged, [95% interval] "
            "(per seed) |",
            "|---|---|---|",
        ]
        for strategy, condition, per_seed in intervals:
            cells = ", ".join(f"{r:+.1%} [{lo:+.1%}, {hi:+.1%}]" for r, lo, hi in per_seed)
            lines.append(f"| {strategy} | {condition} | {cells} |")
    out = os.path.join(HERE, args.out)
    if not args.tiny:
        with open(out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(out + ".json", "w") as f:
            record = {"args": vars(args), "runs": runs}
            if intervals:  # per seed: (ratio, lo, hi)
                record["paired_intervals"] = [list(i) for i in intervals]
            json.dump(record, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

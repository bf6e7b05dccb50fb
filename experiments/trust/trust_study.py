"""Workers you cannot trust: each attack against each aggregator, 4 workers on MNIST-1D.

Each run is `python -m localsgd.train` (4 CPU workers, the MLP, local SGD with k = 10, 400
steps: 40 rounds), worker 1 running one attack of `localsgd.loop.attacks` from the first step
(none: the clean run). The aggregators are `sync.aggregate=mean|clip|trimmed_mean|median` at
their defaults (clip 2x the median norm, trim 0.25), and the mean and the median with
`sync.score=true` (exclude after 3 bad rounds running, 2 in a worker's first 3 rounds:
`sync.probation_rounds`; score fraction 0.5). The keys were at their defaults; how each default
came to be, and on which runs, is in docs/reliability.md. `--setting diloco` repeats it
under DiLoCo (inner AdamW, H = 10), a setting the defaults were not chosen on either;
`--setting streaming_diloco` under Streaming DiLoCo (2 fragments, H = 20, blocking: a fragment
sync every 10 steps, each fragment's rounds robust and scored on their own).

Columns: the final test loss (mean over seeds; a run that stopped on a non-finite loss is
counted as diverged), its ratio to the same aggregator's clean run and to the mean's clean run,
the round at which worker 1 was excluded (scored runs), and the training wall time.
Writes experiments/trust/trust_study_SETTING.{json,md}.

    python experiments/trust/trust_study.py                     # 108 runs, ~10 min on 2 cores
    python experiments/trust/trust_study.py --setting diloco
    python experiments/trust/trust_study.py --tiny              # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))  # the study's folder: its results go here
ROOT = os.path.dirname(os.path.dirname(HERE))
ATTACKS = ["none", "sign_flip", "noise", "stale", "nan", "zeros"]
AGGREGATORS = {
    "mean": [],
    "clip": ["sync.aggregate=clip"],
    "trimmed_mean": ["sync.aggregate=trimmed_mean"],
    "median": ["sync.aggregate=median"],
    # an excluded worker's shard skipped, as before sync.excluded_shard (whose default under
    # scoring is now reassign: the row "mean+score, reassigned")
    "mean+score": ["sync.score=true", "sync.excluded_shard=skip"],
    "median+score": ["sync.aggregate=median", "sync.score=true", "sync.excluded_shard=skip"],
}
# rows run for some attacks only: the mean without its NaN guard (today's all-reduce before
# sync.drop_nonfinite defaulted to true) and a clean run of 3 workers, what is left after one of
# 4 is excluded
EXTRA = {
    "mean, unguarded": (["sync.drop_nonfinite=false"], ["none", "nan"]),
    "mean, 3 workers": (["dist.world_size=3"], ["none"]),
    # scoring with the excluded worker's shard split among the others (sync.excluded_shard)
    "mean+score, reassigned": (["sync.score=true", "sync.excluded_shard=reassign"], ATTACKS),
    # ... and its share of the global batch too (take_over): the honest workers train on as many
    # samples a step as the 4 did
    "mean+score, taken over": (["sync.score=true", "sync.excluded_shard=take_over"], ATTACKS),
    # scoring on a held-out batch of 32 windows: about 5% of an H = 50 round's compute when
    # chosen (three forward passes of 32 against 50 steps of 16 x (forward + backward)); with
    # the evaluations split by samples since 2026-12-06, 1.5 passes at 4 workers
    "mean+score, 32 windows": (["sync.score=true", "sync.score_batch=32"], ATTACKS),
    # the noise floor of a clean run: worker 1 honest but sending 1.0001 times its change at
    # every sync (a sign flip of scale -1.0001), a nudge no rule here acts on; how far the final
    # loss of a seed moves under it is how far any other row's can move for no reason of its own
    "mean, nudged 1e-4": (
        [
            "trainer.callbacks=[{_target_:localsgd.loop.attacks.Attack,kind:sign_flip,rank:1,"
            "scale:-1.0001}]"
        ],
        ["none"],
    ),
}
MNIST1D = ["data=mnist1d", "model=mlp"]
# the Shakespeare LM of experiments/lm_shakespeare (a 215k-parameter GPT, inner AdamW) under
# DiLoCo, scored on 64-character windows of the validation text (a sample's loss: its mean
# over the characters)
SHAKESPEARE = [
    "data=shakespeare",
    "model=transformer",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_model=64",
    "optim=adamw",
    "optim.lr=0.002",
    "lr_schedule.warmup_steps=40",
    "trainer.batch_size=16",
    "trainer.eval_samples=1024",
    "trainer.eval_batch_size=256",
]
SETTINGS = {
    "local_sgd": [*MNIST1D, "sync.period=10"],
    "diloco": [*MNIST1D, "+experiment=diloco", "sync.period=10", "sync.outer_warmup_rounds=0"],
    "lm_diloco": [*SHAKESPEARE, "sync=diloco", "sync.period=10", "sync.outer_warmup_rounds=0"],
    # DiLoCo's rounds at a period nearer the papers' (H = 50), where scoring's held-out passes
    # can be a small part of a round
    "lm_diloco_h50": [*SHAKESPEARE, "sync=diloco", "sync.period=50", "sync.outer_warmup_rounds=0"],
    # Streaming DiLoCo, blocking (delay 0) and replacing (alpha 0), the form a robust
    # aggregate composes with: 2 fragments, each with its own outer step every 20 steps, one
    # fragment sync every 10 (40 rounds, as the others)
    # SparseLoCo's top-k wire (2-bit values, error feedback, the senders' mean), scored as
    # Templar scores it: the mean and clip only (a per-coordinate rule is refused over top-k)
    "sparseloco": [*MNIST1D, "+experiment=untrusted_sparseloco", "sync.score=false"],
    # the same preset on the Shakespeare LM (its model, inner AdamW lr 0.002), a sync every 10
    "lm_sparseloco": [*SHAKESPEARE, "+experiment=untrusted_sparseloco", "sync.score=false"],
    "streaming_diloco": [
        *MNIST1D,
        "+experiment=diloco",
        "sync.period=20",
        "sync.fragments=2",
        "sync.outer_warmup_rounds=0",
    ],
}
ROWS = {**{k: (v, ATTACKS) for k, v in AGGREGATORS.items()}, **EXTRA}


def run_one(setting: str, aggregator: str, attack: str, seed: int, args, run_dir: str) -> dict:
    overrides = [
        f"trainer.max_steps={args.steps}",
        "trainer.progress=false",
        "logger.wandb.mode=disabled",
        "logger.plots=false",
        f"seed={seed}",
        *SETTINGS[setting],
        *ROWS[aggregator][0],
        f"hydra.run.dir={run_dir}",
    ]
    if not any(o.startswith("dist.world_size=") for o in overrides):
        overrides.append("dist.world_size=4")
    if attack != "none":
        overrides.append(
            f"trainer.callbacks=[{{_target_:localsgd.loop.attacks.Attack,kind:'{attack}',"
            f"rank:1,seed:{seed}}}]"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "localsgd.train", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    path = os.path.join(run_dir, "summary.json")
    if proc.returncode != 0 or not os.path.exists(path):
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        # a run that could not train (bad config, missing data) is no result, unlike divergence
        if not any(why in proc.stderr for why in ("non-finite loss", "held NaN or Inf")):
            sys.exit(f"{aggregator}/{attack}/{seed} failed: {last}")
        return {"diverged": True, "why": last[:200]}
    with open(path) as f:
        summary = json.load(f)
    trust = summary.get("trust", {})
    return {
        "diverged": False,
        "test_loss": summary["test_loss"],
        "test_accuracy": summary["test_accuracy"],
        "wall_time_s": summary["wall_time_s"],
        "excluded_round": trust.get("excluded", {}).get("1"),
        # worker 1's contributions that reached an aggregate: scored rounds in which it was
        # neither dropped (non-finite, judged bad) nor excluded
        "attacker_kept": _kept(trust) if "sync.score=true" in ROWS[aggregator][0] else None,
        "excluded": sorted(int(r) for r in trust.get("excluded", {})),
        "dropped_nonfinite": summary.get("dropped_nonfinite", 0),
    }


def _md_commands(out: str) -> list[str]:
    """The commands a table written before the json kept them names (its first paragraphs)."""
    if not os.path.exists(out + ".md"):
        return []
    with open(out + ".md") as f:
        head = f.read().split("\n| ")[0]
    return re.findall(r"`(python experiments/trust/trust_study\.py[^`]*)`", head)


def _quoted(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


def _kept(trust: dict) -> int:
    rounds = trust["trust_rounds"]
    until = trust.get("excluded", {}).get("1", rounds)
    dropped = {
        r
        for w, r in trust.get("judged_bad", []) + trust.get("dropped_nonfinite", [])
        if w == 1 and r < until
    }
    return until - len(dropped)


def table(results: dict, seeds: list[int]) -> list[str]:
    """Means over the seeds a row ran; each ratio is taken against the clean runs of the same
    seeds, so a row run on fewer seeds is not held against another seed's luck."""

    def cell(agg, attack, only=None):  # empty where --rows/--attacks left it out
        return [
            results[k]
            for s in (only if only is not None else seeds)
            if (k := f"{agg}/{attack}/{s}") in results
        ]

    def mean_loss(runs):
        ok = [r["test_loss"] for r in runs if not r["diverged"]]
        return statistics.mean(ok) if ok and len(ok) == len(runs) else None

    def ran(agg, attack):
        return [s for s in seeds if f"{agg}/{attack}/{s}" in results]

    lines = [
        "| aggregator | attack | seeds | test loss | / own clean | / mean clean | accuracy | "
        "worker 1 excluded at round | worker 1's rounds kept | others excluded | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for agg, (_, attacks) in ROWS.items():
        for attack in attacks:
            runs = cell(agg, attack)
            if not runs:
                continue
            those = ran(agg, attack)
            shown_seeds = ",".join(map(str, those))
            loss = mean_loss(runs)
            if loss is None:
                bad = sum(r["diverged"] for r in runs)
                lines.append(
                    f"| {agg} | {attack} | {shown_seeds} | diverged in {bad}/{len(runs)} "
                    "| | | | | | | |"
                )
                continue
            clean = mean_loss(cell(agg, "none", those)) or float("nan")
            clean_mean = mean_loss(cell("mean", "none", those)) or float("nan")
            if len(cell(agg, "none", those)) < len(those):
                clean = float("nan")
            if len(cell("mean", "none", those)) < len(those):
                clean_mean = float("nan")
            acc = statistics.mean(r["test_accuracy"] for r in runs)
            wall = statistics.mean(r["wall_time_s"] for r in runs)
            rounds = [r["excluded_round"] for r in runs]
            others = sorted({w for r in runs for w in r["excluded"] if w != 1})
            shown = ", ".join("-" if x is None else str(x) for x in rounds)
            kept = ", ".join(
                "-" if r.get("attacker_kept") is None else str(r["attacker_kept"]) for r in runs
            )
            lines.append(
                f"| {agg} | {attack} | {shown_seeds} | {loss:.4f} | {loss / clean:.3f} | "
                f"{loss / clean_mean:.3f} | {acc:.3f} | {shown} | {kept} | "
                f"{', '.join(map(str, others)) or '-'} | {wall:.2f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=list(SETTINGS), default="local_sgd")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only-seeds", type=int, nargs="+", help="run these seeds of --seeds")
    parser.add_argument(
        "--seed-list",
        type=int,
        nargs="+",
        help="these seeds instead of 0..--seeds-1 (a check on fresh seeds: pair with --suffix)",
    )
    parser.add_argument("--suffix", default="", help="write trust_study_SETTING_SUFFIX.*")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help="these rows only")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, help="these attacks only")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the setting's committed runs and replace only those run now",
    )
    args = parser.parse_args()
    if args.tiny:
        args.seeds, args.steps = 1, 40
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    run_seeds = args.only_seeds if args.only_seeds is not None else seeds
    name = f"trust_study_{args.setting}" + (f"_{args.suffix}" if args.suffix else "")
    out = os.path.join(HERE, name)
    results, commands = {}, []
    if args.merge and os.path.exists(out + ".json"):
        with open(out + ".json") as f:
            before = json.load(f)
        results, commands = before["results"], before.get("commands") or _md_commands(out)
    with tempfile.TemporaryDirectory() as tmp:
        for agg, (_, attacks) in ROWS.items():
            if args.rows and agg not in args.rows:
                continue
            for attack in attacks:
                if args.attacks and attack not in args.attacks:
                    continue
                for seed in run_seeds:
                    key = f"{agg}/{attack}/{seed}"
                    run_dir = os.path.join(tmp, "".join(c if c.isalnum() else "_" for c in key))
                    results[key] = run_one(args.setting, agg, attack, seed, args, run_dir)
                    print(key, results[key], flush=True)
    if args.tiny:
        return
    command = " ".join(["python experiments/trust/trust_study.py", *map(_quoted, sys.argv[1:])])
    commands.append(command)
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "setting": SETTINGS[args.setting],
                "steps": args.steps,
                "seeds": seeds,
                "commands": commands,
                "results": results,
            },
            f,
            indent=1,
        )
    data = "the Shakespeare LM" if args.setting.startswith("lm") else "MNIST-1D"
    lines = [
        f"# Untrusted workers: {args.setting}, 4 workers, {data}, {args.steps} steps, "
        f"seeds {seeds}",
        "",
        f"`{command}` (means over seeds; worker 1 attacks; docs/reliability.md reads it).",
        *(
            ["", "The runs merged into it, in order: " + "; ".join(f"`{c}`" for c in commands)]
            if len(commands) > 1
            else []
        ),
        "",
        *table(results, seeds),
    ]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

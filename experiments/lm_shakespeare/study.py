"""Local SGD, post-local SGD and DiLoCo on character-level Shakespeare, side by side.

    make data                                           # the corpus, once
    python experiments/lm_shakespeare/study.py run      # the runs not yet in runs.jsonl
    python experiments/lm_shakespeare/study.py run --fresh   # every row x seed, 168 runs, afresh
    python experiments/lm_shakespeare/study.py export   # appends new runs to runs.jsonl
    python experiments/lm_shakespeare/study.py report   # -> report.md and three plots

`run` skips runs that are already in `runs.jsonl` (unless `--fresh`) or finished in the run
directory, and resumes ones that were cut short, so it can be restarted. `export` appends the
finished runs of the run directory that the table lacks; it never drops a kept run. `report`
reads only the committed table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "runs.jsonl"
RUNS = Path(os.environ.get("LM_STUDY_DIR", "/tmp/lm_shakespeare"))
SEEDS3 = (0, 1, 2)  # every row (the first study's 2026-12-03 rows had seeds 0 and 1 first)
STEPS = 2000
TARGET_LOSS = 2.0  # nats per character: the validation loss the time-to-target columns ask for

# A baby GPT (nanoGPT's CPU settings at half the width, so 4 workers fit 2 cores), AdamW inner
# steps as in DiLoCo (beta2 0.95, weight decay 0.1, warmup + cosine), 4 workers, batch 16 x 64
# characters each, and the slow link the comparison is about (1 Gbit/s, 100 ms per collective).
COMMON = [
    "data=shakespeare",
    "model=transformer",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_model=64",
    "optim=adamw",
    "optim.lr=0.002",
    "lr_schedule.warmup_steps=100",
    "dist.world_size=4",
    f"trainer.max_steps={STEPS}",
    "trainer.batch_size=16",
    "trainer.eval_every=200",
    "trainer.eval_samples=1024",
    "trainer.eval_batch_size=256",
    "trainer.log_every=50",
    "trainer.progress=false",
    "comm.simulate.bandwidth_gbps=1",
    "comm.simulate.latency_ms=100",
    "logger=jsonl",
    # the diloco preset warms its outer step up since this study's map (2026-12-04); the rows keep
    # the paper's step unless they say otherwise (the runs before it had 0, the default then)
    "sync.outer_warmup_rounds=0",
]

ROWS = {
    # gradient all-reduce every step for the whole run: synchronous data-parallel AdamW
    "sync": [f"sync.warmup_steps={STEPS}", "sync.period=1"],
    "local_k16": ["sync.period=16"],
    "local_k64": ["sync.period=64"],
    "local_k256": ["sync.period=256"],
    "diloco_h16": ["sync=diloco", "sync.period=16"],
    "diloco_h64": ["sync=diloco", "sync.period=64"],
    "diloco_h256": ["sync=diloco", "sync.period=256"],
    "post_local_k64": ["sync.warmup_steps=500", "sync.period=64"],
    # the communication frontier (issue 20) on the LM: 4-bit pseudo-gradients with error feedback
    # (payload + per-block scales), Streaming DiLoCo with the paper's tau = 1 and alpha = 0.5 (H =
    # 16 with P = 4: one fragment every 4 steps), both together, and the eager outer step
    "diloco_h16_int4ef": ["sync=diloco", "sync.period=16", "sync.comm_dtype=int4",
                          "sync.error_feedback=true"],
    "stream_h16_p4": ["sync=diloco", "sync.period=16", "sync.fragments=4", "sync.delay_steps=1",
                      "sync.merge_alpha=0.5"],
    "stream_h16_p4_int4ef": ["sync=diloco", "sync.period=16", "sync.fragments=4",
                             "sync.delay_steps=1", "sync.merge_alpha=0.5", "sync.comm_dtype=int4",
                             "sync.error_feedback=true"],
    "eager_h16": ["sync=diloco", "sync.period=16", "sync.eager=true"],
    # eager's outer step without momentum: is the delayed half of its step what destabilises it?
    "eager_h16_m0": ["sync=diloco", "sync.period=16", "sync.eager=true",
                     "sync.outer_momentum=0", "sync.outer_nesterov=false"],
    # eager_stability.py's linearised outer step predicts eager's divergence at 4 workers with
    # lr 0.7 and momentum 0.9 (spectral radius 1.14), and stability at 2 workers (0.98) or at
    # outer lr 0.35 (0.98): both predictions, run after the prediction was made
    "eager_h16_w2": ["sync=diloco", "sync.period=16", "sync.eager=true", "dist.world_size=2"],
    "eager_h16_lr035": ["sync=diloco", "sync.period=16", "sync.eager=true", "sync.outer_lr=0.35"],
    # which of streaming's knobs costs the loss: fragments alone (tau = 0, alpha = 0), then
    # fragments with the half-half merge but no overlap (tau = 0, alpha = 0.5)
    "stream_h16_p4_t0a0": ["sync=diloco", "sync.period=16", "sync.fragments=4"],
    "stream_h16_p4_t0a05": ["sync=diloco", "sync.period=16", "sync.fragments=4",
                            "sync.merge_alpha=0.5"],
    # the headline checked on a setting it was not chosen on: 2 workers
    "sync_w2": [f"sync.warmup_steps={STEPS}", "sync.period=1", "dist.world_size=2"],
    "diloco_h16_int4ef_w2": ["sync=diloco", "sync.period=16", "sync.comm_dtype=int4",
                             "sync.error_feedback=true", "dist.world_size=2"],
    "diloco_h16_w2": ["sync=diloco", "sync.period=16", "dist.world_size=2"],
    # issue 21 item 1, the map at 2 workers: plain averaging against DiLoCo at H = 16, 64, 256
    # (125, 31, 8 outer steps), beside the 4-worker rows above
    "local_k16_w2": ["sync.period=16", "dist.world_size=2"],
    "local_k64_w2": ["sync.period=64", "dist.world_size=2"],
    "diloco_h64_w2": ["sync=diloco", "sync.period=64", "dist.world_size=2"],
    "local_k256_w2": ["sync.period=256", "dist.world_size=2"],
    "diloco_h256_w2": ["sync=diloco", "sync.period=256", "dist.world_size=2"],
    # ... and what could make DiLoCo work with 8 outer steps: the outer step warmed up from a
    # plain average over the first 4 outer steps; plain outer SGD (no momentum); a synchronous
    # start (the paper's pretrained setting: 512 synchronous steps, then H = 256), with plain
    # averaging after the same start beside it
    "diloco_h256_w2_ow4": ["sync=diloco", "sync.period=256", "sync.outer_warmup_rounds=4",
                           "dist.world_size=2"],
    # the outer warmup across the map (does it cost where DiLoCo already works?) and at 4 workers
    "diloco_h64_w2_ow4": ["sync=diloco", "sync.period=64", "sync.outer_warmup_rounds=4",
                          "dist.world_size=2"],
    "diloco_h16_w2_ow4": ["sync=diloco", "sync.period=16", "sync.outer_warmup_rounds=4",
                          "dist.world_size=2"],
    "diloco_h256_ow4": ["sync=diloco", "sync.period=256", "sync.outer_warmup_rounds=4"],
    "diloco_h256_sync512": ["sync=diloco", "sync.period=256", "sync.warmup_steps=512"],
    "local_k256_sync512": ["sync.period=256", "sync.warmup_steps=512"],
    "diloco_h256_w2_m0": ["sync=diloco", "sync.period=256", "sync.outer_momentum=0",
                          "sync.outer_nesterov=false", "dist.world_size=2"],
    # the outer lr and momentum tuned by `study.py tune --rows diloco_h256_w2 --trials 10` (TPE
    # on seed 100: tune_diloco_h256_w2.yaml; its best, rounded to 3 digits), then run on 0, 1, 2
    "diloco_h256_w2_tuned": ["sync=diloco", "sync.period=256", "sync.outer_lr=1.018",
                             "sync.outer_momentum=0.517", "dist.world_size=2"],
    # ... and that tuned step at H = 16 and 64 (tuned at 256, not here): for the preset's rule
    "diloco_h16_w2_tuned256": ["sync=diloco", "sync.period=16", "sync.outer_lr=1.018",
                               "sync.outer_momentum=0.517", "dist.world_size=2"],
    "diloco_h64_w2_tuned256": ["sync=diloco", "sync.period=64", "sync.outer_lr=1.018",
                               "sync.outer_momentum=0.517", "dist.world_size=2"],
    # the headline with that step: H = 64 in 4 bits with error feedback (as diloco_h16_int4ef)
    "diloco_h64_w2_tuned256_int4ef": ["sync=diloco", "sync.period=64", "sync.outer_lr=1.018",
                                      "sync.outer_momentum=0.517", "sync.comm_dtype=int4",
                                      "sync.error_feedback=true", "dist.world_size=2"],
    # the outer step tuned per H (`study.py tune --rows diloco_h64_w2 / diloco_h16_w2 --trials 8`,
    # seed 100; the best, rounded to 3 digits), run on 0, 1, 2
    "diloco_h64_w2_tuned64": ["sync=diloco", "sync.period=64", "sync.outer_lr=0.868",
                              "sync.outer_momentum=0.679", "dist.world_size=2"],
    "diloco_h16_w2_tuned16": ["sync=diloco", "sync.period=16", "sync.outer_lr=0.713",
                              "sync.outer_momentum=0.847", "dist.world_size=2"],
    # ... checked at 4 workers, a setting neither the step nor the headline was chosen on
    "diloco_h64_tuned256_int4ef": ["sync=diloco", "sync.period=64", "sync.outer_lr=1.018",
                                   "sync.outer_momentum=0.517", "sync.comm_dtype=int4",
                                   "sync.error_feedback=true"],
    "diloco_h256_w2_sync512": ["sync=diloco", "sync.period=256", "sync.warmup_steps=512",
                               "dist.world_size=2"],
    "local_k256_w2_sync512": ["sync.period=256", "sync.warmup_steps=512", "dist.world_size=2"],
    # ... and the map's other axes at H = 64 (31 outer steps), 2 workers: the inner lr doubled,
    # a constant inner lr (no cosine decay, the same 100 warmup steps), a model of half the width
    # (d_model 32: 57k parameters)
    "local_k64_w2_lr4": ["sync.period=64", "optim.lr=0.004", "dist.world_size=2"],
    "diloco_h64_w2_lr4": ["sync=diloco", "sync.period=64", "optim.lr=0.004", "dist.world_size=2"],
    "local_k64_w2_const": ["sync.period=64", "lr_schedule=constant", "dist.world_size=2"],
    "diloco_h64_w2_const": ["sync=diloco", "sync.period=64", "lr_schedule=constant",
                            "dist.world_size=2"],
    # ... and a model of twice the width (d_model 128, nanoGPT's CPU width: ~0.8M parameters)
    "local_k64_w2_d128": ["sync.period=64", "model.d_model=128", "dist.world_size=2"],
    "diloco_h64_w2_d128": ["sync=diloco", "sync.period=64", "model.d_model=128",
                           "dist.world_size=2"],
    "local_k64_w2_d32": ["sync.period=64", "model.d_model=32", "dist.world_size=2"],
    "diloco_h64_w2_d32": ["sync=diloco", "sync.period=64", "model.d_model=32",
                          "dist.world_size=2"],
    # issue 21 item 2, the large H with 30 outer steps: H = 256 over 7680 steps (3.84 times the
    # budget), 2 workers (a 4-worker run of that length takes ~15 min here), with sync on the same
    # budget
    "sync_w2_7680": ["sync.warmup_steps=7680", "sync.period=1", "dist.world_size=2",
                     "trainer.max_steps=7680"],
    "local_k256_w2_7680": ["sync.period=256", "dist.world_size=2", "trainer.max_steps=7680"],
    "diloco_h256_w2_7680": ["sync=diloco", "sync.period=256", "dist.world_size=2",
                            "trainer.max_steps=7680"],
    "diloco_h256_w2_7680_tuned": ["sync=diloco", "sync.period=256", "dist.world_size=2",
                                  "trainer.max_steps=7680", "sync.outer_lr=1.018",
                                  "sync.outer_momentum=0.517"],
    # issue 21 item 3: non-iid shards, each worker a quarter of the corpus in file order (about
    # ten plays each, `data.partition=contiguous`), beside the iid rows of the same name
    "sync_noniid": [f"sync.warmup_steps={STEPS}", "sync.period=1", "data.partition=contiguous"],
    "local_k16_noniid": ["sync.period=16", "data.partition=contiguous"],
    "diloco_h16_noniid": ["sync=diloco", "sync.period=16", "data.partition=contiguous"],
    # issue 30 item 5, bytes: SparseLoCo's shape (`sync=sparseloco`: top-k 64 of every 4096
    # values in 2 bits, one fp32 scale per chunk, error feedback in place of outer momentum, outer
    # SGD at lr 1) beside diloco_h16_int4ef and sync (kept above), at 4 and 2 workers. Two
    # periods, fixed before any ran, nothing tuned: H = 16, the 4-bit row's (the codec alone
    # differs, as in experiments/sparse/sparse_study.py, where every compressed row had one H),
    # and the preset's own H = 50, the one at or under the 0.001 bytes per parameter per
    # step
    "sparseloco_h50": ["sync=sparseloco"],
    "sparseloco_h16": ["sync=sparseloco", "sync.period=16"],
    "sparseloco_h50_w2": ["sync=sparseloco", "dist.world_size=2"],
    "sparseloco_h16_w2": ["sync=sparseloco", "sync.period=16", "dist.world_size=2"],
    # ... and SparseLoCo's decayed accumulator (e <- 0.95 e + d), which helped the preset on
    # MNIST-1D on every seed (experiments/sparse/sparse_study.md): the check on a setting it was not
    # chosen on (added after sparseloco_h50 seed 0 was seen; the value is the MNIST study's)
    "sparseloco_h50_b95": ["sync=sparseloco", "sync.error_feedback_decay=0.95"],
    # ... and SparseLoCo as its reference code aggregates (added 2026-12-05 after the 600-step
    # probes of sparse_probes.md, seed 0): each index's sum divided by the workers that sent it
    # (`sync.topk_mean=senders`, tplr's scatter_reduce mean) with the reference's decay 0.95.
    # Neither value tuned here: both are the reference's; the probes chose the pair over each alone
    "sparseloco_h50_sb95": ["sync=sparseloco", "sync.topk_mean=senders",
                            "sync.error_feedback_decay=0.95"],
    "sparseloco_h16_sb95": ["sync=sparseloco", "sync.period=16", "sync.topk_mean=senders",
                            "sync.error_feedback_decay=0.95"],
    # ... and the reference's own shape at the bytes (fixed before it ran, from the
    # reference's 500M sweep: top-k 32 of 4096, H = 15, beta 0.95, outer lr 1): 32 of 4096 at
    # H = 20, 0.00094 bytes per parameter per step (100 rounds, against H = 50's 40)
    "sparseloco_h20_d128_sb95": ["sync=sparseloco", "sync.period=20", "sync.topk_density=0.0078125",
                                 "sync.topk_mean=senders", "sync.error_feedback_decay=0.95"],
    # ... checked at 2 workers, a world size the probes never ran
    "sparseloco_h50_sb95_w2": ["sync=sparseloco", "sync.topk_mean=senders",
                               "sync.error_feedback_decay=0.95", "dist.world_size=2"],
    "sparseloco_h16_sb95_w2": ["sync=sparseloco", "sync.period=16", "sync.topk_mean=senders",
                               "sync.error_feedback_decay=0.95", "dist.world_size=2"],
    "sparseloco_h20_d128_sb95_w2": ["sync=sparseloco", "sync.period=20",
                                    "sync.topk_density=0.0078125", "sync.topk_mean=senders",
                                    "sync.error_feedback_decay=0.95", "dist.world_size=2"],
    # ... and the frontier at 0.001 bytes per parameter per step with the Elias-Fano index wire
    # (2026-12-05, branch ef): top-k 46 of 4096 at H = 16 (0.00099), the senders' mean, residual
    # decay 0.9. Chosen on seed 0 at 600 steps by sparse_probes.py (9 probes: stage 1 picked 46/16
    # over 53/18 and 60/20, stage 2 decay 0.9 over 0.95, 0.98 and outer lr 1.5); seeds 1 and 2 and
    # 2 workers are its check on what it was not chosen on
    "sparseloco_h16_k46_sb90": ["sync=sparseloco", "sync.period=16",
                                "sync.topk_density=0.01123046875", "sync.topk_mean=senders",
                                "sync.error_feedback_decay=0.9"],
    "sparseloco_h16_k46_sb90_w2": ["sync=sparseloco", "sync.period=16",
                                   "sync.topk_density=0.01123046875", "sync.topk_mean=senders",
                                   "sync.error_feedback_decay=0.9", "dist.world_size=2"],
    # ... and with outer Nesterov momentum 0.5 at lr 1 and the residual decayed by 0.8 (2026-12-05,
    # branch frontier): the best of 8 600-step probes at seed 0 (sparse_probes.py's MOMENTUM, two
    # stages: DiLoCo's Nesterov 0.9 diverged with the top-k wire at every lr tried; 0.5 at lr 1
    # helped, and decay 0.8 with it, chosen in the second stage after the first was seen); seeds 1
    # and 2 and 2 workers are its check on what it was not chosen on
    "sparseloco_h16_k46_sb80_n5": ["sync=sparseloco", "sync.period=16",
                                   "sync.topk_density=0.01123046875", "sync.topk_mean=senders",
                                   "sync.error_feedback_decay=0.8", "sync.outer_momentum=0.5",
                                   "sync.outer_nesterov=true", "sync.outer_lr=1.0"],
    "sparseloco_h16_k46_sb80_n5_w2": ["sync=sparseloco", "sync.period=16",
                                      "sync.topk_density=0.01123046875", "sync.topk_mean=senders",
                                      "sync.error_feedback_decay=0.8", "sync.outer_momentum=0.5",
                                      "sync.outer_nesterov=true", "sync.outer_lr=1.0",
                                      "dist.world_size=2"],
    # ... and with outer lr 1.2 (2026-12-06, branch fresh): the best of 4 last 600-step probes
    # at seed 0 (sparse_probes.py's FRESH: +5.54% against the row's +6.75%, the rule asked for 0.5
    # point). Run on FRESH_SEEDS only: it was chosen on seed 0, and seeds 1 and 2 had been seen
    # (the row above's), so it is never run on them
    "sparseloco_h16_k46_sb80_n5_lr12": ["sync=sparseloco", "sync.period=16",
                                        "sync.topk_density=0.01123046875",
                                        "sync.topk_mean=senders", "sync.error_feedback_decay=0.8",
                                        "sync.outer_momentum=0.5", "sync.outer_nesterov=true",
                                        "sync.outer_lr=1.2"],
    # issue 30 item 5, optimizer state: beside diloco_h16 (moments local, kept above), DES-LOC
    # (Adam's first moments averaged at every 3rd parameter average, the second at every 6th:
    # `sync.moment_periods=[3,6]`, the paper's K_u = 3 K_x, K_v = 6 K_x) and both moments averaged
    # at every round
    "diloco_h16_desloc": ["sync=diloco", "sync.period=16", "sync.optimizer_state=desloc"],
    "diloco_h16_avg": ["sync=diloco", "sync.period=16", "sync.optimizer_state=average"],
    # ... and, added after desloc's runs were seen (rare characters' embedding rows blew up on every
    # seed), the diagnostic: the second moments averaged with the first, every 3rd round, so that
    # no worker ever divides an averaged m by its own, unaveraged v
    "diloco_h16_desloc_m3v3": ["sync=diloco", "sync.period=16", "sync.optimizer_state=desloc",
                               "sync.moment_periods=[3,3]"],
}  # fmt: skip

# issue 30's check of the 0.001 frontier on seeds nobody had seen (2026-12-06, branch fresh):
# seeds 3, 4, 5, chosen before they ran and never probed or tuned on, for sync and the frontier
# row. They stay out of report.md (its means are over SEEDS3, so that every row there is
# compared with sync on the same seeds); bytes_study.md reads them, each against sync's run of
# the same seed.
FRESH_SEEDS = (3, 4, 5)
ROW_SEEDS = {row: SEEDS3 for row in ROWS}  # 3 seeds a row (issue 21 item 5)
ROW_SEEDS |= {row: SEEDS3 + FRESH_SEEDS for row in ("sync", "sparseloco_h16_k46_sb80_n5")}
ROW_SEEDS["sparseloco_h16_k46_sb80_n5_lr12"] = FRESH_SEEDS  # chosen on seed 0; 1, 2 were seen

# the synchronous row each row's bytes and loss are compared with (same world size)
SYNC_OF = {
    row: "sync_w2_7680" if "_w2_7680" in row
    else None if row.endswith(("_d32", "_d128"))  # no sync at that width: "-"
    else "sync_w2" if "_w2" in row
    else "sync_noniid" if row.endswith("_noniid") else "sync"
    for row in ROWS
}  # fmt: skip


def overrides(row: str) -> list[str]:
    """COMMON with the row's overrides, a row's `key=value` replacing COMMON's for that key."""
    keys = {o.split("=", 1)[0] for o in ROWS[row]}
    return [o for o in COMMON if o.split("=", 1)[0] not in keys] + ROWS[row]


def kept_runs() -> set[str]:
    """The names (`row_sSEED`) of the runs already in the table."""
    if not TABLE.exists():
        return set()
    with TABLE.open(encoding="utf-8") as f:
        return {Path(json.loads(line)["run"]).name for line in f if line.strip()}


def run_dir(row: str, seed: int) -> Path:
    return RUNS / f"{row}_s{seed}"


def run_all(rows: list[str], seeds: list[int] | None, fresh: bool) -> None:
    kept = set() if fresh else kept_runs()
    for row in rows:
        for seed in seeds if seeds is not None else ROW_SEEDS[row]:
            out = run_dir(row, seed)
            if (out / "summary.json").is_file() or out.name in kept:
                continue
            cmd = [sys.executable, "-m", "localsgd.train", *overrides(row), f"seed={seed}",
                   f"hydra.run.dir={out}"]  # fmt: skip
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)


TUNE_SEED = 100  # the seed the outer step is tuned on; the table's rows use 0, 1, 2


def tune(row: str, trials: int) -> None:
    """Optuna (TPE, `+experiment=optuna_outer`) over the outer lr and momentum of a DiLoCo row,
    minimising the final validation loss on seed TUNE_SEED; keeps the sweep's
    `optimization_results.yaml` and every trial's loss in `tune_<row>.yaml` here."""
    import yaml

    if "sync=diloco" not in ROWS[row]:
        sys.exit(f"error: --rows must name a DiLoCo row (sync=diloco), got {row}")
    sweep = RUNS / f"tune_{row}"
    args = [o for o in overrides(row) if o != "sync=diloco"]
    cmd = [sys.executable, "-m", "localsgd.train", "-m", *args, "+experiment=optuna_outer",
           f"seed={TUNE_SEED}", f"hydra.sweeper.n_trials={trials}", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=${hydra.job.num}"]  # fmt: skip
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best["trials"] = []
    for job in sorted((d for d in sweep.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)):
        summary = job / "summary.json"
        cfg = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        keys = ("sync.outer_lr=", "sync.outer_momentum=")
        picked = {o.split("=")[0]: float(o.split("=")[1]) for o in cfg if o.startswith(keys)}
        loss = json.loads(summary.read_text())["test_loss"] if summary.is_file() else None
        best["trials"].append({**picked, "test_loss": loss})
    best["command"] = " ".join(["python", *cmd[1:]])
    out = HERE / f"tune_{row}.yaml"
    out.write_text(yaml.safe_dump(best, sort_keys=False), encoding="utf-8")
    print(f"best {best['best_params']} -> {best['best_value']:.4f}; kept in {out}")


def export() -> None:
    """Append the finished runs of the study's rows that the table does not hold yet."""
    from localsgd.analysis.report import main as report_main

    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "runs.jsonl"
        if report_main([str(RUNS), "--export", str(fresh)]) != 0:
            sys.exit(2)
        kept = kept_runs()
        added = []
        with fresh.open(encoding="utf-8") as f:
            for line in f:
                name = Path(json.loads(line)["run"]).name if line.strip() else ""
                # a row's runs only: `tune`'s trials (tune_<row>/N) are kept in tune_<row>.yaml
                if name and name not in kept and name.rsplit("_s", 1)[0] in ROWS:
                    added.append(line if line.endswith("\n") else line + "\n")
        with TABLE.open("a", encoding="utf-8") as f:
            f.writelines(added)
    print(f"appended {len(added)} runs to {TABLE} (kept {len(kept)})")


def row_of(run) -> str:
    return Path(run.path).name.rsplit("_s", 1)[0]


def first_at_target(run) -> dict | None:
    """The first periodic evaluation with validation loss at or below TARGET_LOSS."""
    for record in run.metrics:
        if record.get("test_loss", math.inf) <= TARGET_LOSS and "wall_time_s" in record:
            return record
    return None


def compute_per_step(runs) -> float:
    """Seconds of local computation per step, the median over the runs given: the wall time less
    the communication time (which holds the simulated link's waits). Every row of one world size
    and width computes the same per step, so one figure serves them all, and the machine's noise
    stays out of the modelled column."""
    return statistics.median(
        (r.summary["wall_time_s"] - r.summary["comm_seconds"]) / r.summary["steps"] for r in runs
    )


def fmt(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def world_size(run) -> int:
    return int(run.summary.get("world_size") or run.config.get("dist.world_size", 4))


def shape(run) -> tuple[int, int]:
    """(workers, width): what the computation per step depends on."""
    return world_size(run), int(run.config.get("model.d_model", 64))


def report() -> None:
    from localsgd.analysis.restate import restate_run
    from localsgd.analysis.runs import read_table

    # the fresh seeds of FRESH_SEEDS are bytes_study.md's: here every row is over seeds 0, 1, 2
    runs = [r for r in read_table(str(TABLE)) if r.config.get("seed") in SEEDS3]
    # the top-k runs sent with int16 indices (before 2026-12-05), as today's wire counts them
    restated = {row_of(r) for r in runs if restate_run(r.summary, r.config, r.metrics)}
    by_row = defaultdict(list)
    for run in runs:
        by_row[row_of(run)].append(run)
    order = [r for r in ROWS if r in by_row]
    step_s = {
        k: compute_per_step([r for r in runs if shape(r) == k])
        for k in sorted(set(map(shape, runs)))
    }

    def mean(row: str, key: str) -> float:
        return statistics.fmean(r.summary[key] for r in by_row[row])

    step_text = ", ".join(
        f"{v * 1e3:.1f} ms at {w} workers, width {d}" for (w, d), v in step_s.items()
    )
    lines = [
        f"{len(runs)} runs from `runs.jsonl` (mean ± std over the seeds, their number in "
        f"*seeds*, each row's `ROW_SEEDS` in `study.py`, seeds 0, 1, 2 only: the fresh seeds "
        f"3, 4, 5 of a few rows are read by bytes_study.md). Validation loss "
        f"in nats per character; *vs sync* is the mean's "
        f"difference from the mean of `sync` at the same world size and budget (-: none of that "
        f"width). Communication per worker, "
        f"counted as sent (payload plus scales for the quantised rows; the top-k rows "
        f"{', '.join(f'`{r}`' for r in sorted(restated))} were sent with int16 indices and are "
        f"restated as the Elias-Fano wire sends the same positions, exactly: "
        f"`localsgd.analysis.restate`; their simulated link times are as run); "
        f"*x fewer* is sync's mean "
        f"bytes over the row's; *MB per round* is bytes / rounds, the most a worker sends at one "
        f"step when rounds are of one size (a fragment is 1/4 of the model give or take the "
        f"embeddings). Wall time: the training loop on the simulated 1 Gbit/s, 100 ms link. "
        f"Target: the first evaluation (every 200 steps, at the next sync) with validation loss "
        f"<= {TARGET_LOSS}; *measured* is its wall time, *modelled* is steps x the median "
        f"computation per step over the runs of that world size ({step_text}) + the run's own "
        f"communication seconds up to then, which keeps the shared machine's noise out.\n",
        "| row | workers | seeds | val loss | vs sync | perplexity | comm rounds | comm MB | "
        "x fewer bytes than sync | MB per round | wall s | steps to target | "
        "to target s, measured | to target s, modelled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in order:
        rs = by_row[row]
        ref = SYNC_OF[row]
        w = world_size(rs[0])
        hits = [h for h in (first_at_target(r) for r in rs) if h is not None]
        missing = "" if len(hits) == len(rs) else f" ({len(rs) - len(hits)} never)"
        per_round = statistics.fmean(r.summary["comm_bytes"] / r.summary["comm_rounds"] for r in rs)
        if ref in by_row:
            gap = f"{100 * (mean(row, 'test_loss') / mean(ref, 'test_loss') - 1):+.2f}%"
            fewer = f"{mean(ref, 'comm_bytes') / mean(row, 'comm_bytes'):.1f}x"
        else:
            gap = fewer = "-"
        lines.append(
            f"| {row} | {w} | {len(rs)} | {fmt([r.summary['test_loss'] for r in rs], 4)} "
            f"| {gap} | {fmt([r.summary['test_perplexity'] for r in rs], 3)} "
            f"| {fmt([r.summary['comm_rounds'] for r in rs], 0)} "
            f"| {fmt([r.summary['comm_bytes'] / 1e6 for r in rs], 1)} | {fewer} "
            f"| {per_round / 1e6:.3f} "
            f"| {fmt([r.summary['wall_time_s'] for r in rs], 0)} "
            f"| {fmt([h['step'] for h in hits], 0)}{missing} "
            f"| {fmt([h['wall_time_s'] for h in hits], 0)} "
            f"| {fmt([h['step'] * step_s[shape(rs[0])] + h['comm_seconds'] for h in hits], 0)} |"
        )  # fmt: skip
    lines += paired_table(by_row)
    lines.append("\n## Samples (seed 0, the averaged model, temperature 0.8, 200 characters)\n")
    for row in order:
        first = min(by_row[row], key=lambda r: r.config.get("seed", 0))
        lines.append(f"**{row}**\n\n```\n{first.summary.get('sample', '').rstrip()}\n```\n")
    (HERE / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines[: 3 + len(order)]))
    curves = [r for r in order if world_size(by_row[r][0]) == 4 and r not in NOT_PLOTTED]
    plot(by_row, curves)
    plot_map(by_row)


# the comparisons the README reads: (what is compared, row a, row b), a - b paired by seed
PAIRS = [
    ("DiLoCo - plain, H=16 (125 outer steps), 4 workers", "diloco_h16", "local_k16"),
    ("DiLoCo - plain, H=64 (31), 4 workers", "diloco_h64", "local_k64"),
    ("DiLoCo - plain, H=256 (8), 4 workers", "diloco_h256", "local_k256"),
    ("DiLoCo - plain, H=16 (125), 2 workers", "diloco_h16_w2", "local_k16_w2"),
    ("DiLoCo - plain, H=64 (31), 2 workers", "diloco_h64_w2", "local_k64_w2"),
    ("DiLoCo - plain, H=256 (8), 2 workers", "diloco_h256_w2", "local_k256_w2"),
    ("inner lr 4e-3: DiLoCo - plain, H=64, 2 workers", "diloco_h64_w2_lr4", "local_k64_w2_lr4"),
    ("constant inner lr: DiLoCo - plain, H=64, 2 workers", "diloco_h64_w2_const",
     "local_k64_w2_const"),
    ("width 32: DiLoCo - plain, H=64, 2 workers", "diloco_h64_w2_d32", "local_k64_w2_d32"),
    ("inner lr 4e-3 - 2e-3, plain, H=64, 2 workers", "local_k64_w2_lr4", "local_k64_w2"),
    ("inner lr 4e-3 - 2e-3, DiLoCo, H=64, 2 workers", "diloco_h64_w2_lr4", "diloco_h64_w2"),
    ("outer warmup 4 - DiLoCo, H=256, 2 workers", "diloco_h256_w2_ow4", "diloco_h256_w2"),
    ("outer warmup 4 - plain, H=256, 2 workers", "diloco_h256_w2_ow4", "local_k256_w2"),
    ("outer warmup 4 - DiLoCo, H=256, 4 workers", "diloco_h256_ow4", "diloco_h256"),
    ("outer warmup 4 - plain, H=256, 4 workers", "diloco_h256_ow4", "local_k256"),
    ("outer warmup 4 - DiLoCo, H=64, 2 workers", "diloco_h64_w2_ow4", "diloco_h64_w2"),
    ("outer warmup 4 - DiLoCo, H=16, 2 workers", "diloco_h16_w2_ow4", "diloco_h16_w2"),
    ("no outer momentum - Nesterov, H=256, 2 workers", "diloco_h256_w2_m0", "diloco_h256_w2"),
    ("no outer momentum - plain, H=256, 2 workers", "diloco_h256_w2_m0", "local_k256_w2"),
    ("tuned outer step - DiLoCo, H=256, 2 workers", "diloco_h256_w2_tuned", "diloco_h256_w2"),
    ("tuned outer step - plain, H=256, 2 workers", "diloco_h256_w2_tuned", "local_k256_w2"),
    ("tuned outer step - outer warmup 4, H=256, 2 workers", "diloco_h256_w2_tuned",
     "diloco_h256_w2_ow4"),
    ("tuned at H=64 - paper's step, H=64, 2 workers", "diloco_h64_w2_tuned64", "diloco_h64_w2"),
    ("tuned at H=64 - tuned at H=256, H=64, 2 workers", "diloco_h64_w2_tuned64",
     "diloco_h64_w2_tuned256"),
    ("tuned at H=16 - paper's step, H=16, 2 workers", "diloco_h16_w2_tuned16", "diloco_h16_w2"),
    ("H=256's tuned step - outer warmup 4, H=64, 2 workers", "diloco_h64_w2_tuned256",
     "diloco_h64_w2_ow4"),
    ("H=256's tuned step - outer warmup 4, H=16, 2 workers", "diloco_h16_w2_tuned256",
     "diloco_h16_w2_ow4"),
    ("H=256's tuned step - paper's step, H=64, 2 workers", "diloco_h64_w2_tuned256",
     "diloco_h64_w2"),
    ("H=256's tuned step - paper's step, H=16, 2 workers", "diloco_h16_w2_tuned256",
     "diloco_h16_w2"),
    ("512 sync steps first: DiLoCo - plain, H=256, 2 workers", "diloco_h256_w2_sync512",
     "local_k256_w2_sync512"),
    ("512 sync steps first: DiLoCo - plain, H=256, 4 workers", "diloco_h256_sync512",
     "local_k256_sync512"),
    ("512 sync steps first - from scratch, DiLoCo H=256, 2 workers", "diloco_h256_w2_sync512",
     "diloco_h256_w2"),
    ("width 128: DiLoCo - plain, H=64, 2 workers", "diloco_h64_w2_d128", "local_k64_w2_d128"),
    ("30 outer steps (H=256, 7680 steps): DiLoCo - plain, 2 workers", "diloco_h256_w2_7680",
     "local_k256_w2_7680"),
    ("30 outer steps: tuned step - paper's, H=256, 2 workers", "diloco_h256_w2_7680_tuned",
     "diloco_h256_w2_7680"),
    ("30 outer steps: tuned step - plain, H=256, 2 workers", "diloco_h256_w2_7680_tuned",
     "local_k256_w2_7680"),
    ("30 outer steps: DiLoCo - sync, H=256, 2 workers", "diloco_h256_w2_7680", "sync_w2_7680"),
    ("30 outer steps: tuned step - sync, H=256, 2 workers", "diloco_h256_w2_7680_tuned",
     "sync_w2_7680"),
    ("H=64 tuned step, 4 bits + EF - fp32, 2 workers", "diloco_h64_w2_tuned256_int4ef",
     "diloco_h64_w2_tuned256"),
    ("H=64 tuned step, 4 bits + EF - sync, 2 workers", "diloco_h64_w2_tuned256_int4ef",
     "sync_w2"),
    ("H=64 tuned step, 4 bits + EF - sync, 4 workers", "diloco_h64_tuned256_int4ef", "sync"),
    ("H=64 tuned step, 4 bits + EF - paper's step fp32, 4 workers", "diloco_h64_tuned256_int4ef",
     "diloco_h64"),
    ("H=64 tuned step, 4 bits + EF - plain, 4 workers", "diloco_h64_tuned256_int4ef",
     "local_k64"),
    ("non-iid - iid, sync", "sync_noniid", "sync"),
    ("non-iid - iid, plain H=16", "local_k16_noniid", "local_k16"),
    ("non-iid - iid, DiLoCo H=16", "diloco_h16_noniid", "diloco_h16"),
    ("non-iid: DiLoCo - plain, H=16", "diloco_h16_noniid", "local_k16_noniid"),
    ("non-iid: DiLoCo - sync, H=16", "diloco_h16_noniid", "sync_noniid"),
    ("eager - DiLoCo, H=16, 2 workers", "eager_h16_w2", "diloco_h16_w2"),
    ("eager (outer lr 0.35) - DiLoCo, H=16, 4 workers", "eager_h16_lr035", "diloco_h16"),
]  # fmt: skip


def paired_table(by_row) -> list[str]:
    """PAIRS as a table. A difference counts when it has one sign on every seed and its mean is
    larger than the spread: the larger std of the two rows and the std of the paired differences."""
    lines = [
        "\n## Paired differences (final validation loss, a - b, by seed)\n",
        "| comparison | a | b | seeds | a - b per seed | mean ± std | counts |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, a, b in PAIRS:
        if a not in by_row or b not in by_row:
            continue
        la = {r.config.get("seed"): r.summary["test_loss"] for r in by_row[a]}
        lb = {r.config.get("seed"): r.summary["test_loss"] for r in by_row[b]}
        seeds = sorted(set(la) & set(lb))
        d = [la[s] - lb[s] for s in seeds]
        if not d:
            continue
        spread = max(statistics.stdev(v.values()) if len(v) > 1 else 0.0 for v in (la, lb))
        spread = max(spread, statistics.stdev(d) if len(d) > 1 else 0.0)
        mean = statistics.fmean(d)
        counts = (all(x > 0 for x in d) or all(x < 0 for x in d)) and abs(mean) > spread
        lines.append(
            f"| {label} | {a} | {b} | {len(d)} | {', '.join(f'{x:+.4f}' for x in d)} "
            f"| {mean:+.4f} ± {statistics.stdev(d) if len(d) > 1 else 0.0:.4f} "
            f"| {'yes' if counts else 'no'} |"
        )
    return lines


# the diagnostics and the non-iid rows stay in the table, out of the curves (20 lines are too many)
NOT_PLOTTED = {"eager_h16_m0", "stream_h16_p4_t0a0", "stream_h16_p4_t0a05", "sync_noniid",
               "local_k16_noniid", "diloco_h16_noniid", "eager_h16_lr035",
               # issue 30's optimizer-state rows and diagnostics: bytes_study.md reads them
               "diloco_h16_desloc", "diloco_h16_avg", "diloco_h16_desloc_m3v3",
               "sparseloco_h50_b95", "sparseloco_h50_sb95", "sparseloco_h16_sb95",
               "sparseloco_h50_sb95_w2", "sparseloco_h16_sb95_w2",
               "sparseloco_h20_d128_sb95", "sparseloco_h20_d128_sb95_w2",
               "sparseloco_h16_k46_sb90", "sparseloco_h16_k46_sb90_w2",
               "sparseloco_h16_k46_sb80_n5", "sparseloco_h16_k46_sb80_n5_w2",
               "sparseloco_h16_k46_sb80_n5_lr12"}  # fmt: skip


def plot_map(by_row) -> None:
    """Final validation loss against the number of outer steps (H = 16, 64, 256 in 2000 steps),
    plain averaging and DiLoCo at each world size, mean ± std over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for suffix, workers, colour in (("", 4, "C0"), ("_w2", 2, "C1")):
        methods = (("local_k", "plain averaging", "--"), ("diloco_h", "DiLoCo", "-"))
        for prefix, label, style in methods:
            xs, ys, es = [], [], []
            for h in (16, 64, 256):
                runs = by_row.get(f"{prefix}{h}{suffix}", [])
                if runs:
                    losses = [r.summary["test_loss"] for r in runs]
                    xs.append(STEPS / h)
                    ys.append(statistics.fmean(losses))
                    es.append(statistics.stdev(losses) if len(losses) > 1 else 0.0)
            if xs:
                ax.errorbar(xs, ys, yerr=es, fmt=style, marker="o", color=colour, capsize=3,
                            label=f"{label}, {workers} workers")  # fmt: skip
        sync = by_row.get("sync" + suffix, [])
        if sync:
            mean = statistics.fmean(r.summary["test_loss"] for r in sync)
            ax.axhline(mean, color=colour, lw=0.8, ls=":", label=f"sync, {workers} workers")
    ax.set_xscale("log")
    ax.set_xticks([STEPS / h for h in (256, 64, 16)], ["8\n(H=256)", "31\n(H=64)", "125\n(H=16)"])
    ax.set_xlabel("outer steps in 2000 inner steps")
    ax.set_ylabel("final validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "map_outer_steps.png", dpi=110)
    plt.close(fig)


def plot(by_row, order) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_spec = [
        ("step", "optimizer step", "loss_vs_step.png", 1.0),
        ("comm_bytes", "communication per worker (MB, log)", "loss_vs_comm_bytes.png", 1e6),
        ("wall_time_s", "wall time on the simulated 1 Gbit/s 100 ms link (s)",
         "loss_vs_sim_wall.png", 1.0),
    ]  # fmt: skip
    COLOURS = plt.get_cmap("tab20" if len(order) > 10 else "tab10")  # noqa: N806
    for x_key, xlabel, name, scale in axes_spec:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in order:
            points = defaultdict(list)
            for run in by_row[row]:
                for rec in run.metrics:
                    if "test_loss" in rec and x_key in rec:
                        points[rec["step"]].append((rec[x_key] / scale, rec["test_loss"]))
            steps = sorted(s for s in points if len(points[s]) == len(by_row[row]))
            xs = [statistics.fmean(p[0] for p in points[s]) for s in steps]
            ys = [statistics.fmean(p[1] for p in points[s]) for s in steps]
            style = (":" if row == "sync" else "--" if row.startswith("diloco")
                     else "-." if row.startswith(("stream", "eager")) else "-")  # fmt: skip
            ax.plot(xs, ys, style, marker=".", label=row, color=COLOURS(order.index(row)))
        if x_key == "comm_bytes":
            ax.set_xscale("log")
        ax.axhline(TARGET_LOSS, color="grey", lw=0.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_ylim(top=2.6)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(HERE / name, dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", choices=("run", "export", "report", "tune"))
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seeds", nargs="*", type=int, help="default: each row's own seeds")
    parser.add_argument("--fresh", action="store_true", help="also rerun runs kept in the table")
    parser.add_argument("--trials", type=int, default=10, help="tune: Optuna trials")
    args = parser.parse_args()
    if args.action == "run":
        run_all(args.rows, args.seeds, args.fresh)
    elif args.action == "tune":
        for row in args.rows:
            tune(row, args.trials)
    elif args.action == "export":
        export()
    else:
        report()


if __name__ == "__main__":
    main()

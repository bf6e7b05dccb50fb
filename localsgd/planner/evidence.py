"""What the studies measured about each setting's final loss against synchronous training.

One `Finding` per (setting, studied job, world size, model where a study varied it): the final
test/validation loss gap to the synchronous run (a gradient all-reduce every step, or k = 1) of
the same seed, per seed, as the study's tables give them (docs/studies.md). A setting is *backed*
on a job when the studies ran it there and every seed of every world size and model ended within
2% of sync; the plan recommends only backed settings (and sync itself). Nothing here is
extrapolated: a setting the studies did not run on a job, or ran with other knobs (another outer
step, another H), is "not studied" there.
"""

from __future__ import annotations

from dataclasses import dataclass

WITHIN = 2.0  # percent: "within 2% of sync", the studies' bar

# the studied jobs (`job_of` tells which one a config is like)
LM = "lm"  # Shakespeare, the baby GPT (4 blocks, d_model 64), inner AdamW lr 2e-3, 2000 steps
MNIST1D = "mnist1d"  # MNIST-1D, the MLP, 4 workers, 1000 steps, SGD with momentum 0.9 at lr 0.1
JOBS = {
    LM: "the Shakespeare LM (4-block GPT, inner AdamW, 2000 steps)",
    MNIST1D: "MNIST-1D (MLP, SGD with momentum, 1000 steps)",
}


@dataclass(frozen=True)
class Finding:
    setting: str  # a grid key (localsgd.planner.grid)
    job: str  # LM | MNIST1D
    workers: int
    gaps: tuple[float, ...]  # percent, per seed (negative: below sync's loss)
    study: str  # where it is written down
    model: str = ""  # where the study ran another model than the job's own

    @property
    def within(self) -> bool:
        return all(g <= WITHIN for g in self.gaps)

    def describe(self) -> str:
        on = f" ({self.model})" if self.model else ""
        return f"{', '.join(f'{g:+.1f}%' for g in self.gaps)} at {self.workers} workers{on}"


# experiments/lm_shakespeare/README.md, its bytes_study.md, experiments/ksweep/README.md, and
# below experiments/mnist1d_grid/study.md
_LM_README = "lm_shakespeare"
_BYTES = "lm_shakespeare/bytes_study"
_KSWEEP = "ksweep/iid"
_MLP = "MLP 256-256"  # the k-sweep's; the plan check's MNIST-1D job has 256-256-256

FINDINGS = (
    # --- the Shakespeare LM (docs/studies.md: the LM, its frontier and bytes studies) ---------
    Finding("plain-h16", LM, 4, (9.65,), _LM_README + ": local_k16 (mean of 3 seeds)"),
    Finding("plain-h16", LM, 2, (4.63,), _LM_README + ": local_k16_w2 (mean of 3 seeds)"),
    Finding("plain-h64", LM, 4, (11.96,), _LM_README + ": local_k64 (mean of 3 seeds)"),
    Finding("plain-h64", LM, 2, (5.80,), _LM_README + ": local_k64_w2 (mean of 3 seeds)"),
    Finding("diloco-h16", LM, 4, (0.65, 0.33, 1.08), _BYTES + ": diloco_h16 (DES-LOC table)"),
    Finding("diloco-h16", LM, 2, (-2.46,), _LM_README + ": diloco_h16_w2 (mean of 3 seeds)"),
    Finding("diloco-h16-int4", LM, 4, (0.69, 0.42, 1.07), _BYTES + ": diloco_h16_int4ef"),
    Finding("diloco-h16-int4", LM, 2, (-2.33, -2.90, -1.88), _BYTES + ": diloco_h16_int4ef_w2"),
    Finding("diloco-h64", LM, 4, (9.31,), _LM_README + ": diloco_h64 (mean of 3 seeds)"),
    Finding("diloco-h64", LM, 2, (4.45,), _LM_README + ": diloco_h64_w2 (mean of 3 seeds)"),
    Finding("stream-h16-p4-t0", LM, 4, (1.30,), _LM_README + ": stream_h16_p4_t0a0 (mean of 3)"),
    Finding("stream-h16-p4-t1", LM, 4, (5.16,), _LM_README + ": stream_h16_p4 (mean of 3 seeds)"),
    Finding("stream-h16-p4-t1-int4", LM, 4, (5.15,), _LM_README + ": stream_h16_p4_int4ef"),
    Finding(
        "topk-h16",
        LM,
        4,
        (1.02, 1.98, 2.33, 1.93, 1.69, 1.86),
        _BYTES + ": sparseloco_h16_k46_sb80_n5 (seeds 0-5)",
    ),
    Finding("topk-h16", LM, 2, (1.71, 1.84, 2.16), _BYTES + ": sparseloco_h16_k46_sb80_n5"),
    # --- MNIST-1D ---------------------------------------------------------------------------
    Finding("plain-h16", MNIST1D, 4, (-1.55, -1.60, -2.03, -2.13, -5.60), _KSWEEP + ": k=16", _MLP),
    Finding("plain-h64", MNIST1D, 4, (4.45, 8.20, 9.12, 6.64, 0.25), _KSWEEP + ": k=64", _MLP),
)

# experiments/mnist1d_grid (study.md): every grid setting beside sync on the plan check's MNIST-1D
# job (MLP 256-256-256), seeds 0-2, at 4 and 2 workers and with the MLP 128-128-128 at 4 workers
_GRID_STUDY = "mnist1d_grid"
_GRID_CONFIGS = ((4, "w4", ""), (2, "w2", ""), (4, "w4-narrow", "MLP 128-128-128"))
_GRID_GAPS = {  # setting: the gaps per seed of each configuration above, in its order
    "plain-h16": ((-9.30, -4.11, -9.93), (3.52, 9.12, 2.25), (0.92, 3.17, -0.20)),
    "plain-h16-overlap": ((-10.82, -2.74, -8.38), (7.27, 7.47, 3.57), (1.59, 6.41, 5.55)),
    "plain-h64": ((-0.20, 7.35, 0.13), (15.41, 18.40, 13.57), (20.80, 29.39, 32.32)),
    "diloco-h16": ((64.81, 106.19, 65.49), (113.98, 157.63, 112.76), (61.11, 45.99, 60.67)),
    "diloco-h16-bf16": ((60.47, 97.85, 86.86), (194.18, 146.24, 110.09), (55.46, 31.59, 62.01)),
    "diloco-h16-int4": ((68.99, 93.54, 80.36), (113.15, 130.96, 122.46), (56.63, 49.46, 67.20)),
    "topk-h16": ((43.65, 43.41, 48.06), (51.43, 50.81, 50.87), (65.29, 73.85, 68.30)),
    "diloco-h64": ((122.10, 165.14, 156.18), (121.28, 113.50, 137.55), (139.90, 112.64, 120.94)),
    "diloco-h64-int4": (
        (151.55, 156.10, 162.29),
        (130.81, 121.67, 97.72),
        (139.59, 107.58, 134.28),
    ),
    "stream-h16-p4-t0": ((81.24, 87.31, 104.25), (113.19, 138.21, 115.34), (65.35, 65.42, 56.44)),
    "stream-h16-p4-t1": ((-5.56, 3.11, -4.45), (0.39, -0.11, -2.25), (-0.38, 3.72, 1.52)),
    "stream-h16-p4-t4": ((-6.94, 1.84, -1.60), (-2.57, -0.59, -2.29), (-2.47, 0.32, -1.41)),
    "stream-h16-p4-t1-int4": ((-9.68, 1.59, -4.61), (-1.47, -1.14, -1.55), (-1.04, -0.63, -5.22)),
    "stream-h64-p4-t4": ((18.71, 32.34, 20.81), (22.32, 19.03, 13.46), (32.78, 29.76, 27.55)),
    "stream-h64-p4-t4-int4": ((11.43, 29.30, 18.12), (19.44, 19.13, 15.51), (32.67, 35.18, 33.04)),
}
FINDINGS += tuple(
    Finding(setting, MNIST1D, workers, gaps, f"{_GRID_STUDY}: {config} (seeds 0-2)", model)
    for setting, per_config in _GRID_GAPS.items()
    for (workers, config, model), gaps in zip(_GRID_CONFIGS, per_config, strict=True)
)


@dataclass(frozen=True)
class Verdict:
    backed: bool
    text: str  # what the studies say, in a few words
    study: str


def verdict(setting: str, job: str | None) -> Verdict:
    """What the studies say about `setting`'s loss on `job` (None: a job they did not study,
    where nothing but sync is backed; the findings on other jobs are shown for reference)."""
    if setting == "ddp":
        return Verdict(True, "is sync (the reference)", "")
    here = [f for f in FINDINGS if f.setting == setting and f.job == job]
    if here:
        backed = all(f.within for f in here)
        word = "within 2% of sync" if backed else "not within 2% of sync"
        if not backed and any(f.within for f in here):
            word = "within 2% in some of the studied settings only"
        elif not backed and any(g <= WITHIN for f in here for g in f.gaps):
            word = "within 2% on some seeds only"
        return Verdict(
            backed,
            f"{word}: {'; '.join(f.describe() for f in here)}",
            "; ".join(dict.fromkeys(f.study for f in here)),
        )
    elsewhere = [f for f in FINDINGS if f.setting == setting]
    if elsewhere:
        other = elsewhere[0]
        return Verdict(
            False,
            f"not studied on this job (on {other.job}: {other.describe()})",
            other.study,
        )
    return Verdict(False, "not studied", "")


def job_of(data_target: str, model_target: str) -> str | None:
    """Which studied job a config is like, from its data and model: the character-level text
    sets with the transformer are the LM's; MNIST-1D with the MLP is the k-sweeps'."""
    data, model = data_target.rsplit(".", 1)[-1], model_target.rsplit(".", 1)[-1]
    if data in ("shakespeare", "text") and model == "transformer":
        return LM
    if data == "mnist1d" and model == "mlp":
        return MNIST1D
    return None

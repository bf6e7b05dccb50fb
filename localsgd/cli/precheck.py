"""What the launcher checks and decides before Hydra starts, and again in each Hydra job.

Hydra writes `.hydra/` into the run directory before `main` runs, so a bad command is refused
here first, in one line, leaving an earlier run's files untouched: the config's ranges
(`localsgd.cli.checks`), the data and model (`localsgd.cli.preflight`), the device, the run
directory (writable, not in use, the run of this job to continue: `localsgd.cli.run_dir`), and
under `-m` every job of a basic sweep before the first starts.
"""

from __future__ import annotations

import json
import os
import tempfile

from omegaconf import OmegaConf

from localsgd.cli import run_dir as run_dirs
from localsgd.cli.checks import _get, validate
from localsgd.cli.hf_checks import check_hf
from localsgd.cli.launch import resolve_world_size, under_torchrun
from localsgd.cli.overrides import CONF_DIR, composition_error, split_config_dirs
from localsgd.cli.preflight import check_data, has_validation, resolve_resume
from localsgd.config import ConfigError
from localsgd.loop import checkpoint

MULTIRUN_FLAGS = ("-m", "--multirun")


def world_size_of(cfg) -> int:
    if _get(cfg, "dist.virtual_workers") is not None:
        return _get(cfg, "dist.virtual_workers")
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return resolve_world_size(cfg.dist.world_size, cfg.dist.device)


def check_device(cfg) -> None:
    """CUDA asked for by name on a machine whose torch sees none: refused here, not in a worker."""
    import torch

    if torch.cuda.is_available() or _get(cfg, "dist.virtual_workers") is not None:
        return
    if _get(cfg, "dist.device") == "cuda":
        raise ConfigError(
            "dist.device=cuda needs a CUDA device, and torch sees none here "
            "(torch.cuda.is_available() is False); use dist.device=auto or cpu"
        )
    if _get(cfg, "dist.backend") == "nccl":
        raise ConfigError(
            "dist.backend=nccl needs CUDA devices, and torch sees none here; use "
            "dist.backend=auto (gloo on CPU, nccl on CUDA) or gloo"
        )


def preflight(cfg, run_dir: str | None, quiet: bool = False) -> tuple[str | None, int | None]:
    """Every check that can fail before a worker starts; returns the checkpoint to resume and
    trainer.max_steps when trainer.max_epochs sets it (None otherwise)."""
    world_size = world_size_of(cfg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else None
    validate(cfg, world_size=world_size, local_world_size=local)
    check_device(cfg)
    check_hf(cfg)  # model=hf / data=hf files and sizes, before anything is tokenized or built
    steps = check_data(cfg, world_size)
    check_keep_best(cfg)
    resume = resolve_resume(cfg, world_size, run_dir, quiet)
    if run_dir is not None and os.path.exists(os.path.join(run_dir, "summary.json")):
        check_extension(cfg, run_dir, resume, steps)
    return resume, steps


def check_objective(cfg) -> None:
    """What a sweeper optimises (`optimized_metric`) must be in every job's summary: a `val_*`
    metric needs the validation split (checked before the sweep starts; a single run's
    objective is read by nobody)."""
    metric = _get(cfg, "optimized_metric")
    if str(metric).startswith("val_") and not has_validation(cfg, world_size_of(cfg)):
        test = "test_" + str(metric)[len("val_") :]
        raise ConfigError(
            f"optimized_metric={metric} needs the validation split, and data.val_fraction=0 "
            f"leaves none: set data.val_fraction > 0, or optimized_metric={test} to tune on the "
            f"test set"
        )


def check_keep_best(cfg) -> None:
    """trainer.keep_best keeps the best weights by the validation metric; what it cannot do yet
    is refused (a sharded model is gathered by its whole group; under torchft the writer
    changes)."""
    if not _get(cfg, "trainer.keep_best"):
        return
    metric = str(_get(cfg, "optimized_metric"))
    if not metric.startswith("val_"):
        raise ConfigError(
            f"trainer.keep_best keeps the best weights by optimized_metric, which must be a "
            f"val_* key (the validation split: val_accuracy, val_loss), got {metric}"
        )
    if not has_validation(cfg, world_size_of(cfg)):
        raise ConfigError(
            "trainer.keep_best needs the validation split, and data.val_fraction=0 leaves none"
        )
    for key, allowed in (("dist.shard_size", 1), ("ft.backend", "none")):
        if _get(cfg, key) != allowed:
            raise ConfigError(
                f"trainer.keep_best must be false with {key}={_get(cfg, key)} (not built yet: "
                f"{key}={allowed} only)"
            )


def check_extension(cfg, run_dir: str, resume: str | None, steps: int | None) -> None:
    """A finished run is never overwritten; it continues only when the command asks for more
    steps than it trained and its final checkpoint is there to continue from."""
    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            finished = int(json.load(f)["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        finished = None
    if finished is None:
        raise ConfigError(
            f"hydra.run.dir: {run_dir} already holds a finished run; choose another directory"
        )
    wanted = steps if steps is not None else _get(cfg, "trainer.max_steps")
    final = resume is not None and checkpoint.written_at(resume) == finished
    if wanted > finished and final:
        return
    if not final:
        raise ConfigError(
            f"hydra.run.dir: {run_dir} already holds a run finished after {finished} steps, "
            f"with no checkpoint of its last step to continue from; choose another directory"
        )
    raise ConfigError(
        f"hydra.run.dir: {run_dir} already holds a run finished after {finished} steps; to "
        f"train it further, run the same command with trainer.max_steps above {finished} (it "
        f"continues from its final checkpoint), or choose another directory"
    )


def check_writable(key: str, folder: str) -> None:
    """`folder` can be made and written to: probed where it, or its nearest existing parent, is
    (a file or folder made there and removed: nothing is left behind)."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        if not os.path.isdir(probe):
            raise NotADirectoryError(20, "not a directory")
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".localsgd-probe-"))
    except OSError as e:
        raise ConfigError(
            f"{key} must be a directory this command can create and write to, got {folder} "
            f"({e.strerror or type(e).__name__} at {probe}); choose another, e.g. "
            f"{key}=runs/NAME"
        ) from None


def decides_run_dir(cfg=None) -> bool:
    """The process that picks and holds the run directory: the launcher, or torchrun's rank 0;
    under ft=torchft, the first replica group's (`ft.replica_id` ending in 0), as every group's
    torchrun may share one directory (its leading group writes the checkpoints)."""
    if not under_torchrun():
        return True
    if os.environ.get("RANK", "0") != "0":
        return False
    from localsgd.cli.fault_tolerance import replica_index

    index = replica_index(getattr(getattr(cfg, "ft", None), "replica_id", None))
    return index in (None, 0)


# What `precheck` chose for `main`: the line saying which run continues (or why none could)
chosen: dict[str, str] = {}


def compose_job(args: list[str]):
    """The config `args` compose to (with Hydra's own node), as a Hydra job would see it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose("config", overrides=args, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise composition_error(e) from None


def _resolved(cfg, key: str) -> str | None:
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(cfg, key)
    except OmegaConfBaseException:
        return None  # e.g. an interpolation only a running Hydra job can resolve


def precheck(args: list[str]) -> str | None:
    """Compose and check the config before Hydra starts; `--config-dir` is honoured, `-m` checks
    every job of the sweep, Hydra's other flags are left to the per-job check in `main`.

    Returns the run directory chosen here (`localsgd.cli.run_dir`: the run of this job to
    continue, or a new one) when `hydra.run.dir` is a timestamped pattern, else None."""
    extra_dirs, args = split_config_dirs(args)
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    args = [a for a in args if a not in MULTIRUN_FLAGS]
    if any(a.startswith("-") for a in args):
        return None
    if extra_dirs:  # what Hydra's --config-dir does: add the folders to the search path
        args = [*args, f"hydra.searchpath=[{','.join('file://' + d for d in extra_dirs)}]"]
    if multirun:
        from localsgd.cli.sweeps import check_sweep

        def check_job(job: list[str]) -> None:
            cfg = compose_job(job)
            preflight(cfg, None, quiet=True)
            check_objective(cfg)

        base = check_sweep(args, compose_job, check_job)
        sweep_dir = _resolved(base, "hydra.sweep.dir")
        if sweep_dir is not None and decides_run_dir():
            check_writable("hydra.sweep.dir", sweep_dir)
        return None
    cfg = compose_job(args)
    run_dir = _resolved(cfg, "hydra.run.dir")
    pattern = cfg.hydra.run._get_node("dir")._value()
    stamped = run_dirs.pattern_root(pattern) if isinstance(pattern, str) else None
    decides = decides_run_dir(cfg) and run_dir is not None
    chosen.clear()
    continuing = False
    if decides and stamped is not None and _get(cfg, "trainer.resume") == "auto":
        job = run_dirs.job_overrides(args, extra_dirs)
        found = run_dirs.find_run(*stamped, job, _has_checkpoint)
        if found.run_dir is not None:
            run_dir, continuing = found.run_dir, True
            chosen["line"] = (
                f"trainer.resume=auto: continuing {run_dir}, the newest unfinished run of this "
                f"job (trainer.resume=never starts a new one)"
            )
        elif found.line is not None:
            chosen["line"] = found.line
    elif decides and stamped is None and (pid := run_dirs.in_use(run_dir)) is not None:
        raise run_dirs.in_use_error(run_dir, pid)
    preflight(cfg, run_dir, quiet=True)  # `main` repeats it and warns then
    if not decides:
        return None
    check_writable("hydra.run.dir", run_dir)
    if stamped is None or continuing:
        return run_dir if continuing else None
    # a new one is claimed now: another command started in the same second gets another
    return run_dirs.new_run_dir(run_dir)


def _has_checkpoint(run_dir: str) -> bool:
    return checkpoint.newest_complete(run_dir, None) is not None

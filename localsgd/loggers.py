"""Where metrics go: `metrics.jsonl` always, wandb on rank 0, nothing at all on the other ranks.

Only the rank-0 worker builds real loggers; every other rank gets an empty `Loggers`, so the
training loop calls the same methods everywhere and no rank but 0 touches files or wandb.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Protocol

from localsgd.config import Config, SyncConfig, plain
from localsgd.metrics import MetricsWriter

# x axes a wandb chart may use instead of the step: samples seen and bytes communicated
STEP_AXES = ("samples", "comm_bytes", "comm_rounds")


class Logger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def close(self, failed: bool) -> None: ...


def strategy_name(sync: SyncConfig) -> str:
    """What wandb's `job_type` says: the averaging strategy the `sync` config runs, named as its
    conf/sync/ preset (read from what the config does, so `sync.outer=diloco` on the command
    line is labelled diloco too). The most specific feature wins: levels, an outer optimizer, an
    adaptive period, a synchronous warmup, then k=1 or plain local SGD."""
    if sync.levels:
        return "hierarchical"
    if sync.outer != "none":
        return sync.outer
    if sync.schedule == "adaptive":
        return "adaptive"
    if sync.warmup_steps > 0:
        return "post_local_sgd"
    return "sync_sgd" if sync.period == 1 else "local_sgd"


class JsonlLogger:
    """One JSON object per line in `metrics.jsonl`; the summary goes to summary.json elsewhere."""

    def __init__(self, path: str, append: bool = False):
        self.writer = MetricsWriter(path, append=append)

    def log(self, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run in the run directory: config = the resolved Hydra config, one run per job."""

    def __init__(self, cfg: Config, run_dir: str):
        import wandb  # imported only where used: the other ranks never load it

        w = cfg.logger.wandb
        self.run = wandb.init(
            mode=w.mode,
            project=w.project,
            entity=w.entity,
            tags=list(w.tags) or None,
            name=w.name,
            group=w.group,
            job_type=strategy_name(cfg.sync),
            config=plain(cfg),
            dir=run_dir,
            # no console capture or system sampling: they cost a thread and CPU in every worker
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("step")
        for axis in STEP_AXES:
            self.run.define_metric(axis)
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict[str, Any]) -> None:
        # wandb's own step is the optimizer step, so train and eval lines of a step share a row
        self.run.log(record, step=int(record["step"]))

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Loggers:
    """Fans each call out to every logger; closing is always attempted on all of them."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def summary(self, values: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.summary(values)

    def close(self, failed: bool = False) -> None:
        errors = []
        for logger in self.loggers:
            try:
                logger.close(failed)
            except Exception as e:  # noqa: BLE001 - the others must still close
                errors.append(e)
        self.loggers = []
        if errors:
            raise errors[0]


def build_loggers(cfg: Config, run_dir: str, is_main: bool, append: bool = False) -> Loggers:
    """`append`: a resumed run continues `metrics.jsonl` (its wandb run is a new one)."""
    if not is_main:
        return Loggers([])
    loggers: list[Logger] = [JsonlLogger(os.path.join(run_dir, "metrics.jsonl"), append)]
    if cfg.logger.wandb.mode != "disabled":
        try:
            loggers.append(WandbLogger(cfg, run_dir))
        except BaseException:
            Loggers(loggers).close(failed=True)
            raise
    return Loggers(loggers)


def offline_runs(run_dir: str) -> list[str]:
    """The offline wandb runs written under `run_dir`, for the `wandb sync` hint."""
    # escaped: override-named run dirs hold glob characters, e.g. model.hidden=[64]
    return sorted(glob.glob(os.path.join(glob.escape(run_dir), "wandb", "offline-run-*")))

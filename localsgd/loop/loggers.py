"""Where metrics go: `metrics.jsonl` always, wandb on rank 0, nothing at all on the other ranks.

Only the rank-0 worker builds real loggers; every other rank gets an empty `Loggers`, so the
training loop calls the same methods everywhere and no rank but 0 touches files or wandb.
"""

from __future__ import annotations

import glob
import json
import os
import uuid
from typing import Any, Protocol

from localsgd.config import Config, plain
from localsgd.loop.metrics import MetricsWriter
from localsgd.loop.strategies import strategy_name

# x axes a wandb chart may use instead of the step: samples seen and bytes communicated
STEP_AXES = ("samples", "comm_bytes", "comm_rounds")


class Logger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def close(self, failed: bool) -> None: ...


# Where a `logger.wandb` key is null, wandb's own environment variable decides, as wandb users
# expect (WANDB_MODE=disabled is the usual way to keep scripts and CI off wandb); where that is
# unset too, the fallback. An explicit config value always wins.
WANDB_ENV = {
    "mode": "WANDB_MODE",
    "project": "WANDB_PROJECT",
    "entity": "WANDB_ENTITY",
    "dir": "WANDB_DIR",
}
WANDB_FALLBACK = {"mode": "offline", "project": "localsgd"}
WANDB_MODES = ("offline", "online", "disabled")  # logger.wandb.mode, as wandb.init takes them
WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}  # wandb's older names
RUN_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run continues the same wandb run


def resolve_wandb_settings(w: Any, env: dict[str, str] | None = None) -> None:
    """Fill each unset key of the `logger.wandb` config `w` (attributes) in place."""
    env = os.environ if env is None else env
    for key, var in WANDB_ENV.items():
        if getattr(w, key) is None:
            setattr(w, key, env.get(var) or WANDB_FALLBACK.get(key))
    w.mode = WANDB_MODE_ALIASES.get(w.mode, w.mode)
    if w.mode not in WANDB_MODES:
        raise ValueError(f"WANDB_MODE must be one of {', '.join(WANDB_MODES)}, got {w.mode!r}")


def wandb_run_id(run_dir: str) -> str:
    """The wandb run id of this run directory, made on its first start and kept for resumes."""
    path = os.path.join(run_dir, RUN_ID_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:12]  # wandb's alphabet: lower-case letters and digits
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    return run_id


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
    """A wandb run in the run directory: config = the resolved Hydra config, one run per job
    (resumes included: the run id lives in the run directory)."""

    def __init__(self, cfg: Config, run_dir: str, replay: list[dict[str, Any]] | None = None):
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
            dir=w.dir or run_dir,
            id=wandb_run_id(run_dir),
            resume="allow",  # a resumed run (trainer.resume) continues the same curve
            # no console capture or system sampling: they cost a thread and CPU in every worker
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric("step")
        for axis in STEP_AXES:
            self.run.define_metric(axis)
        self.run.define_metric("*", step_metric="step")
        # A resumed run re-sends the curve up to its checkpoint: a SIGKILL can lose what wandb
        # still buffered for the killed launch, and wandb keeps one value per step anyway (the
        # values are the same: the resume is exact). Online, wandb already has steps < run.step.
        for record in replay or []:
            if record["step"] >= self.run.step:
                self.log(record)

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


def read_records(jsonl: JsonlLogger) -> list[dict[str, Any]]:
    with open(jsonl.writer.path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_loggers(cfg: Config, run_dir: str, is_main: bool, append: bool = False) -> Loggers:
    """`append`: a resumed run continues `metrics.jsonl` (and its wandb run, by the id kept in
    the run directory)."""
    if not is_main:
        return Loggers([])
    loggers: list[Logger] = [JsonlLogger(os.path.join(run_dir, "metrics.jsonl"), append)]
    resolve_wandb_settings(cfg.logger.wandb)  # done by the launcher; not by every caller
    if cfg.logger.wandb.mode != "disabled":
        try:
            loggers.append(WandbLogger(cfg, run_dir, read_records(loggers[0]) if append else []))
        except BaseException:
            Loggers(loggers).close(failed=True)
            raise
    return Loggers(loggers)


def offline_runs(run_dir: str) -> list[str]:
    """The offline wandb runs written under `run_dir`, for the `wandb sync` hint."""
    # escaped: override-named run dirs hold glob characters, e.g. model.hidden=[64]
    return sorted(glob.glob(os.path.join(glob.escape(run_dir), "wandb", "offline-run-*")))

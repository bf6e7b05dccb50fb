"""`python -m localsgd.train [overrides]`: the Hydra entry point.

Without torchrun it spawns `dist.world_size` local workers; under torchrun each rank runs this
module itself and spawns nothing. The configuration is validated and resolved here, in the
launching process, before any worker starts: workers get it typed (`localsgd.config.Config`
dataclass objects) and the run directory.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import shlex
import shutil
import sys
import threading
import traceback

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from localsgd.averaging.virtual import VIRTUAL_BACKEND
from localsgd.cli import run_dir as run_dirs
from localsgd.cli.fault_tolerance import (
    ReplicasFailed,
    ReplicasStopped,
    replica_group_info,
    run_replicas,
)
from localsgd.cli.launch import (
    WorkerFailed,
    WorkerInfo,
    init_process_group,
    pick_backend,
    pick_device,
    spawn,
    torchrun_info,
    under_torchrun,
)
from localsgd.cli.outcome import show, summary_line
from localsgd.cli.overrides import (
    CONF_PACKAGE,
    check_experiment_optimizer,
    check_overrides,
    split_config_dirs,
)
from localsgd.cli.precheck import (
    check_objective,
    chosen,
    decides_run_dir,
    precheck,
    preflight,
    world_size_of,
)
from localsgd.cli.proctitle import launcher_title, set_title
from localsgd.cli.virtual import spawn_virtual
from localsgd.config import Config, ConfigError, register_schemas, typed
from localsgd.loop.checkpoint import resume_line
from localsgd.loop.fault_tolerance import NoLivePeer
from localsgd.loop.loggers import offline_runs, resolve_wandb_settings
from localsgd.loop.metrics import notice, set_notice_log
from localsgd.loop.stop import agreed_stop, first_signal, stopped_exit_code

register_schemas()


def run_worker(
    info: WorkerInfo, store: dist.Store | None, cfg: Config, run_dir: str, resume: str | None
) -> None:
    """One worker, from process-group setup to teardown."""
    import torch

    from localsgd.loop import stop
    from localsgd.loop.trainer import Trainer  # workers import the heavy parts, the CLI stays quick

    if threading.current_thread() is threading.main_thread():  # virtual workers: the launcher's
        set_title(worker_title(info))  # whoever forked it (under ft=torchft: nobody else names it)
        stop.install_sigterm_handler()  # SIGTERM: checkpoint at an agreed step, then exit cleanly
    if cfg.trainer.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    virtual = cfg.dist.virtual_workers is not None
    device = pick_device("cpu" if virtual else cfg.dist.device, info.local_rank)
    backend = VIRTUAL_BACKEND if virtual else pick_backend(cfg.dist.backend, device)
    if cfg.ft.backend == "none":
        store = init_process_group(info, backend, cfg.dist.timeout_s, store)
    elif under_torchrun():  # this machine's ranks are one replica group
        store = init_process_group(torchrun_info(), backend, cfg.dist.timeout_s)
    else:  # a replica group of one process: across groups, torchft's Manager averages
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
        )
    try:
        run_dir = agree_on_run_dir(run_dir, info.rank)
        set_notice_log(run_log(run_dir), bar_elsewhere=cfg.trainer.progress)
        resume = agree_on(resume)
        try:
            Trainer(cfg, info, device, run_dir, resume_from=resume, store=store).train()
        except Exception:  # the launcher says one line; the whole traceback goes to the log
            with open(run_log(run_dir), "a", encoding="utf-8") as log:
                log.write(f"worker rank {info.rank} failed:\n{traceback.format_exc()}")
            raise
    finally:
        dist.destroy_process_group()


def worker_title(info: WorkerInfo) -> str:
    """`ps`'s name for this worker (localsgd/cli/proctitle.py)."""
    if under_torchrun():
        return f"localsgd worker {info.rank}/{info.world_size} (torchrun)"
    launcher = multiprocessing.parent_process()
    where = f" (launcher {launcher.pid})" if launcher is not None else ""
    return f"localsgd worker {info.rank}/{info.world_size}{where}"


def agree_on(value):
    """Rank 0's value on every rank (e.g. which checkpoint to resume from under torchrun, where
    each rank looked for itself)."""
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree_on_run_dir(run_dir: str, rank: int) -> str:
    """Under torchrun every rank resolved `${now:...}` itself; rank 0's directory wins, and the
    others remove the empty directories Hydra made for them."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return run_dir
    chosen = [run_dir]
    dist.broadcast_object_list(chosen, src=0)
    if rank != 0 and os.path.abspath(chosen[0]) != os.path.abspath(run_dir):
        leftovers = set(os.listdir(run_dir)) if os.path.isdir(run_dir) else set()
        if leftovers <= {".hydra", "train.log"}:
            shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(chosen[0], exist_ok=True)
    return chosen[0]


def name_wandb_run(wandb_cfg) -> None:
    """Fill in what only the launching process knows: the run name from the command-line
    overrides, and the multirun sweep as the group, so a sweep is one group on the dashboard."""
    hydra_cfg = HydraConfig.get()
    resolve_wandb_settings(wandb_cfg)
    if wandb_cfg.name is None:
        wandb_cfg.name = hydra_cfg.job.override_dirname or None
    if wandb_cfg.group is None and hydra_cfg.mode == RunMode.MULTIRUN:
        wandb_cfg.group = hydra_cfg.sweep.dir


def run_log(run_dir: str) -> str:
    """Hydra's job log (`${hydra.job.name}.log`), where every process of the run appends its
    notices: Hydra's logging writes nothing of ours there."""
    return os.path.join(run_dir, "train.log")


def fail(message: str, code: int = 2) -> None:
    notice(f"error: {message}")
    sys.exit(code)


# pkg://: the configs are the package localsgd.conf, in a checkout and in an installed wheel alike
@hydra.main(version_base="1.3", config_path=f"pkg://{CONF_PACKAGE}", config_name="config")
def main(cfg: DictConfig) -> float | None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        return run_job(cfg, run_dir)
    finally:  # the basic launcher runs a sweep's jobs in this one process
        run_dirs.let_go(run_dir)


def job_of_this_run() -> list[str]:
    """This job's identity (`localsgd.cli.run_dir.job_overrides`), from Hydra's own record of
    its overrides (a sweep's job: its values)."""
    extra_dirs, _ = split_config_dirs(sys.argv[1:])
    return run_dirs.job_overrides(list(HydraConfig.get().overrides.task), extra_dirs)


def run_job(cfg: DictConfig, run_dir: str) -> float | None:
    torchrun = under_torchrun()
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    decides = decides_run_dir(cfg)
    try:
        resume, epoch_steps = preflight(cfg, run_dir)
        if sweep:  # a sweeper reads the objective (Optuna's trials are checked here)
            check_objective(cfg)
        if decides:
            run_dirs.hold(run_dir)  # two commands never train in one directory at once
    except ConfigError as e:
        fail(str(e))
    # Only now: a refused command must not write into an earlier run's log
    set_notice_log(run_log(run_dir), bar_elsewhere=cfg.trainer.progress)
    if decides:
        run_dirs.write_job_file(run_dir, job_of_this_run())
    if chosen.get("line"):
        notice(chosen.pop("line"))
    summary_path = os.path.join(run_dir, "summary.json")
    run_cfg = typed(cfg)  # resolved here: workers cannot resolve ${hydra:...} or ${now:...}
    try:
        name_wandb_run(run_cfg.logger.wandb)
    except ValueError as e:
        fail(str(e))
    if epoch_steps is not None:  # workers, the LR schedule and the summary count steps
        run_cfg.trainer.max_steps = epoch_steps
    if resume is not None:
        notice(f"resuming from {resume}")
        shard_size, world = run_cfg.dist.shard_size, world_size_of(run_cfg)
        line = resume_line(resume, world, shard_size)
        if line is not None:
            notice(line)
    stopped_by = None
    if torchrun:
        info = torchrun_info()
        if run_cfg.ft.backend != "none":
            info = replica_group_info(run_cfg.ft, info)
        set_title(f"localsgd worker {info.rank}/{info.world_size} (torchrun)")
        try:
            run_worker(info, None, run_cfg, run_dir, resume)
        except NoLivePeer as e:  # a group restarted after the others finished
            notice(f"ft: {e}")
            return None
        except Exception as e:  # one line naming the rank; torchrun then stops the others
            last = (str(e).strip().splitlines() or [""])[-1]
            fail(f"worker rank {info.rank} failed: {type(e).__name__}: {last}", code=1)
        stopped_by = first_signal()
        if info.rank != 0:  # rank 0 may not have written summary.json yet: the agreed step tells
            agreed = agreed_stop()
            if agreed is not None and agreed < run_cfg.trainer.max_steps:
                sys.exit(stopped_exit_code(stopped_by))  # torchrun's exit follows its ranks'
            return None
    else:
        world_size = world_size_of(run_cfg)
        run_cfg.dist.world_size = world_size
        try:
            # By module name: under hydra/launcher=local|slurm, submitit runs this function in a
            # process whose `__main__` is not this file, where `__main__.run_worker` is no name.
            from localsgd.cli.train import run_worker as worker

            if run_cfg.dist.virtual_workers is not None:  # threads of this process
                stopped_by = spawn_virtual(
                    worker, world_size, run_cfg.dist.timeout_s, args=(run_cfg, run_dir, resume)
                )
            elif run_cfg.ft.backend == "none":
                stopped_by = spawn(
                    worker, world_size, run_cfg.dist.timeout_s, args=(run_cfg, run_dir, resume)
                )
            else:
                outcome = run_replicas(worker, run_cfg, args=(run_cfg, run_dir, resume))
                if outcome["lost"]:
                    lost = ", ".join(map(str, outcome["lost"]))
                    notice(f"ft: finished without worker(s) {lost} (lost for good)")
        except (WorkerFailed, ReplicasFailed) as e:
            where = f" (its traceback: {run_log(run_dir)})" if getattr(e, "raised", False) else ""
            fail(f"{e}{where}", code=1)
        except ReplicasStopped as e:  # every worker stopped at an agreed round, checkpointed
            stopped_by = e.signum
    if not os.path.exists(summary_path):  # stopped by SIGTERM or Ctrl-C after a checkpoint
        code = stopped_exit_code(stopped_by)
        show(f"run dir: {run_dir} (interrupted, with a checkpoint)")
        if torchrun:
            show("to resume: run the same torchrun command again")
        else:
            extra_dirs, _ = split_config_dirs(sys.argv[1:])
            args = [a for d in extra_dirs for a in ("--config-dir", d)]
            args += list(HydraConfig.get().overrides.task)
            show(f"to resume (or run the same command again): "
                 f"{run_dirs.resume_command(args, run_dir)}")  # fmt: skip
        show(f"stopped with a checkpoint, not finished: exit code {code}", err=True)
        sys.exit(code)
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    show(f"run dir: {run_dir}")
    show(summary_line(summary))
    if "sample" in summary:
        show(f"sample:\n{summary['sample']}")
    if run_cfg.logger.plots and (plot := write_run_plot(run_dir)):
        show(f"plot: {plot}")
    if run_cfg.logger.wandb.mode == "offline":
        for path in offline_runs(run_dir):
            show(f"wandb offline run: upload it with `wandb sync {shlex.quote(path)}`")
    if not sweep:
        return None  # nobody reads a single run's objective
    try:
        return objective(summary, run_cfg.optimized_metric)
    except ConfigError as e:
        fail(str(e))


def write_run_plot(run_dir: str) -> str | None:
    """The run's loss against step, beside its summary.json; the run has finished either way,
    so a plotting error is one line, never a failed run."""
    try:
        from localsgd.analysis.plots import plot_run  # matplotlib: only now

        return plot_run(run_dir)
    except Exception as e:
        notice(f"warning: no plot written into {run_dir}: {type(e).__name__}: {e}")
        return None


def objective(summary: dict, metric: str) -> float:
    """The value a Hydra sweeper (e.g. Optuna) optimises: the summary's `optimized_metric`. The
    run has finished either way; a name that is not a number of its summary.json is refused."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not number(summary.get(metric)):
        numeric = ", ".join(k for k, v in summary.items() if number(v))
        raise ConfigError(
            f"optimized_metric must be a numeric key of summary.json ({numeric}), got {metric!r}"
        )
    return summary[metric]


def cli() -> None:
    set_title(launcher_title(sys.argv[1:]))
    extra_dirs, args = split_config_dirs(sys.argv[1:])
    if "--help" in args or "-h" in args or "--list-experiments" in args:
        from localsgd.cli.help import help_text, list_experiments

        listing = "--list-experiments" in args
        print((list_experiments if listing else help_text)(tuple(extra_dirs)))
        return
    try:
        check_overrides(sys.argv[1:])
        check_experiment_optimizer(sys.argv[1:])
        chosen = precheck(sys.argv[1:])
    except ConfigError as e:
        fail(str(e))
    if chosen is not None:  # Hydra resolves nothing more: the directory is this one
        sys.argv.append(run_dirs.quote_override("hydra.run.dir", chosen))
    main()


if __name__ == "__main__":
    cli()

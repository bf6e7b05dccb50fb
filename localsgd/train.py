"""`python -m localsgd.train [overrides]`: the Hydra entry point.

Without torchrun it spawns `dist.world_size` local workers; under torchrun each rank runs this
module itself and spawns nothing. The configuration is validated and resolved here, in the
launching process, before any worker starts: workers get a plain dict and the run directory.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

import hydra
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from localsgd.config import Config, ConfigError, validate
from localsgd.launch import (
    WorkerFailed,
    WorkerInfo,
    init_process_group,
    pick_backend,
    pick_device,
    resolve_world_size,
    spawn,
    torchrun_info,
    under_torchrun,
)
from localsgd.loggers import offline_runs
from localsgd.overrides import check_overrides

ConfigStore.instance().store(name="config_schema", node=Config)


def run_worker(info: WorkerInfo, store: dist.Store | None, cfg: dict, run_dir: str) -> None:
    """One worker, from process-group setup to teardown."""
    from localsgd.trainer import Trainer  # workers import the heavy parts, the CLI stays quick

    device = pick_device(cfg["dist"]["device"], info.local_rank)
    backend = pick_backend(cfg["dist"]["backend"], device)
    init_process_group(info, backend, cfg["dist"]["timeout_s"], store)
    try:
        run_dir = agree_on_run_dir(run_dir, info.rank)
        Trainer(cfg, info, device, run_dir).train()
    finally:
        dist.destroy_process_group()


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


def name_wandb_run(wandb_cfg: dict) -> None:
    """Fill in what only the launching process knows: the run name from the command-line
    overrides, and the multirun sweep as the group, so a sweep is one group on the dashboard."""
    hydra_cfg = HydraConfig.get()
    if wandb_cfg["name"] is None:
        wandb_cfg["name"] = hydra_cfg.job.override_dirname or None
    if wandb_cfg["group"] is None and hydra_cfg.mode == RunMode.MULTIRUN:
        wandb_cfg["group"] = hydra_cfg.sweep.dir


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    torchrun = under_torchrun()
    try:
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]) if torchrun else None)
    except ConfigError as e:
        fail(str(e))
    run_dir = HydraConfig.get().runtime.output_dir
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        fail(f"hydra.run.dir: {run_dir} already holds a finished run; choose another directory")
    plain = OmegaConf.to_container(cfg, resolve=True)
    name_wandb_run(plain["logger"]["wandb"])
    if torchrun:
        run_worker(torchrun_info(), None, plain, run_dir)
        if int(os.environ["RANK"]) != 0:
            return None
    else:
        world_size = resolve_world_size(plain["dist"]["world_size"], plain["dist"]["device"])
        plain["dist"]["world_size"] = world_size
        try:
            # By module name: under hydra/launcher=local|slurm, submitit runs this function in a
            # process whose `__main__` is not this file, where `__main__.run_worker` is no name.
            from localsgd.train import run_worker as worker

            spawn(worker, world_size, plain["dist"]["timeout_s"], args=(plain, run_dir))
        except WorkerFailed as e:
            fail(str(e), code=1)
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    print(f"run dir: {run_dir}")
    print(
        "summary: "
        + ", ".join(
            f"{k}={summary[k]}"
            for k in (
                "test_accuracy",
                "test_loss",
                "steps",
                "comm_rounds",
                "comm_bytes",
                "wall_time_s",
            )
        )
    )
    if plain["logger"]["wandb"]["mode"] == "offline":
        for path in offline_runs(run_dir):
            print(f"wandb offline run: upload it with `wandb sync {shlex.quote(path)}`")
    return summary["test_accuracy"]  # the objective a Hydra sweeper (e.g. Optuna) maximises


def cli() -> None:
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        fail(str(e))
    main()


if __name__ == "__main__":
    cli()

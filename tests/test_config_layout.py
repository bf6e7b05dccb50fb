"""The config's one source of truth: groups that mirror the code (sync/, optim/, lr_schedule/,
logger/), experiments as deltas on them, defaults defined once in the schema, `_target_`
optimizers and schedules, the typed config workers get, and wandb's job_type."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from unittest import mock

import pytest
import torch
import yaml

from localsgd.cli.checks import validate
from localsgd.config import (
    DATA_OPTIONS,
    AdamWConfig,
    CommConfig,
    Config,
    ConfigError,
    DataOptions,
    DistConfig,
    LoggerConfig,
    SGDConfig,
    SyncConfig,
    TrainerConfig,
    WarmupCosineConfig,
)
from localsgd.loop.optim import build_optimizer, build_schedule
from localsgd.loop.strategies import strategy_name
from tests.helpers import CONF, FAST, compose_config, run_cli

# What every experiment that existed before the groups did (its old file, key by key): the
# deltas must give exactly these settings.
OLD_EXPERIMENTS = {
    "sync_sgd": {"sync.period": 1, "sync.warmup_steps": 0},
    "local_sgd": {"sync.period": 16, "sync.warmup_steps": 0},
    "post_local_sgd": {"sync.period": 16, "sync.warmup_steps": 300},
    "hierarchical": {
        "sync.warmup_steps": 0,
        "sync.levels.0.period": 4,
        "sync.levels.0.group_size": 2,
        "sync.levels.1.period": 32,
        "sync.levels.1.group_size": "world",
    },  # fmt: skip
    "diloco": {
        "sync.period": 50,
        "sync.warmup_steps": 0,
        "sync.outer": "diloco",
        "sync.outer_warmup_rounds": 4,  # the Shakespeare study's map
        "optim._target_": "torch.optim.AdamW",
        "optim.lr": 0.003,
        "optim.weight_decay": 0.1,
        "optim.betas": [0.9, 0.95],
    },  # fmt: skip
    "slowmo": {"sync.period": 16, "sync.warmup_steps": 0, "sync.outer": "slowmo"},
    "untrusted": {"sync.period": 10, "sync.aggregate": "median", "sync.score": True},
    "untrusted_streaming": {
        "sync.fragments": 4,
        "sync.delay_steps": 0,
        "sync.merge_alpha": 0,
        "sync.aggregate": "median",
        "sync.score": True,
    },  # fmt: skip
    "untrusted_sparseloco": {
        "sync.compress": "topk",
        "sync.period": 10,
        "sync.topk_mean": "senders",
        "sync.error_feedback_decay": 0.9,
        "sync.aggregate": "mean",
        "sync.score": True,
        "optim.lr": 0.003,
    },  # fmt: skip
    "sparseloco_nesterov": {
        "sync.compress": "topk",
        "sync.period": 16,
        "sync.topk_density": 46 / 4096,
        "sync.outer_momentum": 0.5,
        "sync.outer_nesterov": True,
        "optim._target_": "torch.optim.AdamW",
    },  # fmt: skip
    "adaptive_period": {
        "sync.period": 4,
        "sync.warmup_steps": 0,
        "sync.schedule": "adaptive",
        "sync.period_factor": 2,
        "sync.min_period": 2,
        "sync.max_period": 64,
        "sync.adaptive_tolerance": 0.01,
    },  # fmt: skip
    "streaming_diloco": {
        "sync.period": 48,
        "sync.outer": "diloco",
        "sync.fragments": 4,
        "sync.delay_steps": 1,
        "sync.merge_alpha": 0.5,
        "optim._target_": "torch.optim.AdamW",
    },  # fmt: skip
    "sweep_period": {"sync.warmup_steps": 0},
    "sweep_warmup": {"sync.period": 16},
    "sweep_lr": {},
    "optuna_lr": {},
    "optuna_outer": {"sync.outer": "diloco", "optimized_metric": "val_loss"},
    "hf_llama_shakespeare": {
        "sync.outer": "diloco",
        "sync.period": 25,
        "dist.world_size": 2,
        "optim._target_": "torch.optim.AdamW",
        "model._target_": "localsgd.models.hf.causal_lm",
        "model.family": "llama",
        "model.hidden_size": 128,
        "model.num_hidden_layers": 4,
        "data._target_": "localsgd.data.hf.hf_text",
        "data.tokenizer": None,  # bytes
    },  # fmt: skip
    "diloco_muon": {
        "sync.period": 50,
        "sync.outer": "diloco",
        "optim._target_": "localsgd.loop.muon.MuonAdamW",
        "optim.lr": 0.003,
        "model._target_": "localsgd.models.mlp",  # the CNN has no matrix for Muon
    },  # fmt: skip
}
JOB_TYPES = {
    "sync_sgd": "sync_sgd",
    "local_sgd": "local_sgd",
    "post_local_sgd": "post_local_sgd",
    "hierarchical": "hierarchical",
    "diloco": "diloco",
    "slowmo": "slowmo",
    "adaptive_period": "adaptive",
    "streaming_diloco": "streaming_diloco",
}


def _at(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if part.isdigit():
            node = node[int(part)]
        else:  # a `_target_` config of no schema is a plain dict
            node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def test_every_experiment_file_is_listed_here():
    names = {f[:-5] for f in os.listdir(os.path.join(CONF, "experiment")) if f.endswith(".yaml")}
    assert names == set(OLD_EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(OLD_EXPERIMENTS))
def test_experiment_deltas_compose_validate_and_keep_their_settings(name):
    cfg = compose_config([f"+experiment={name}"])
    validate(cfg, world_size=4)
    for key, value in OLD_EXPERIMENTS[name].items():
        assert _at(cfg, key) == value, key
    if name in JOB_TYPES:
        assert strategy_name(cfg.sync) == JOB_TYPES[name]
    with open(os.path.join(CONF, "experiment", f"{name}.yaml")) as f:
        text = f.read()
    assert text.startswith("# @package _global_")
    if name in JOB_TYPES:  # a strategy experiment picks its sync preset rather than restating it
        assert yaml.safe_load(text)["defaults"][0] == {"override /sync": name.replace(
            "_period", "")}  # fmt: skip


@pytest.mark.parametrize(
    "option", sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "sync")) if f.endswith("yaml"))
)
def test_each_sync_preset_is_the_strategy_wandb_names(option):
    cfg = compose_config([f"sync={option}"])
    validate(cfg, world_size=4)
    assert strategy_name(cfg.sync) == option  # wandb's job_type


def test_the_groups_mirror_the_code():
    for group in ("sync", "optim", "lr_schedule", "logger", "experiment"):
        assert os.path.isdir(os.path.join(CONF, group)), group
    assert set(os.listdir(os.path.join(CONF, "sync"))) >= {
        f"{n}.yaml"
        for n in (
            "sync_sgd",
            "local_sgd",
            "post_local_sgd",
            "hierarchical",
            "diloco",
            "slowmo",
            "adaptive",
        )  # fmt: skip
    }


def test_defaults_are_defined_once_in_the_schema():
    with open(os.path.join(CONF, "config.yaml")) as f:
        top = yaml.safe_load(f)
    # config.yaml picks presets and configures Hydra; it restates no setting
    assert set(top) == {"defaults", "hydra"}
    cfg = compose_config([])
    assert isinstance(cfg, Config)
    for section, schema in (
        ("dist", DistConfig()),
        ("trainer", TrainerConfig()),
        ("sync", SyncConfig()),
        ("comm", CommConfig()),
        ("logger", LoggerConfig()),
    ):
        assert getattr(cfg, section) == schema, section
    assert cfg.optim == SGDConfig() and cfg.lr_schedule == WarmupCosineConfig()
    # the values `make train` and the README's results were measured with
    assert (cfg.trainer.max_steps, cfg.optim.weight_decay, cfg.lr_schedule.warmup_steps) == (
        3000, 1e-4, 50)  # fmt: skip
    for group in ("optim", "lr_schedule"):  # the presets only extend their schema
        for name in os.listdir(os.path.join(CONF, group)):
            with open(os.path.join(CONF, group, name)) as f:
                assert set(yaml.safe_load(f)) == {"defaults"}, name


def test_workers_get_typed_config_objects():
    cfg = compose_config(["optim=adamw", "optim.lr=0.001"])
    assert isinstance(cfg.trainer, TrainerConfig) and isinstance(cfg.sync, SyncConfig)
    assert isinstance(cfg.optim, AdamWConfig) and cfg.optim.lr == 0.001


def test_optimizer_and_schedule_are_built_from_their_targets():
    cfg = compose_config(["optim=adamw"])
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model.parameters(), cfg.optim)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.95) or list(group["betas"]) == [0.9, 0.95]
    assert (group["lr"], group["weight_decay"]) == (4e-4, 0.1)
    # The default warmup + cosine, bit for bit the formula runs were measured with before it
    # became a `_target_` (lr * (s+1) / W in the warmup, then floor + (lr - floor) * cosine).
    sched = build_schedule(compose_config(["lr_schedule.min_lr_ratio=0.1"]).lr_schedule, 3000)
    lr, warm, floor = 0.1, 50, 0.1 * 0.1
    for step in (0, 7, 49, 50, 51, 1234, 2999, 3000):
        if step < warm:
            old = lr * (step + 1) / warm
        else:
            progress = min(1.0, (step - warm) / (3000 - warm))
            old = floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        assert sched(step, lr) == old, step
    step_sched = build_schedule(
        compose_config(["lr_schedule=step", "lr_schedule.decay_steps=[10,20]"]).lr_schedule, 30
    )
    assert [step_sched(s, 1.0) for s in (9, 10, 25)] == [1.0, 0.1, 0.1 * 0.1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_optimizer_of_your_own_through_config_dir(tmp_path):
    # Adagrad's lr_decay is no SGD argument: the run only succeeds if `_target_` built Adagrad
    (tmp_path / "conf" / "optim").mkdir(parents=True)
    (tmp_path / "conf" / "optim" / "adagrad.yaml").write_text(
        "_target_: torch.optim.Adagrad\nlr: 0.05\nlr_decay: 0.001\n"
    )
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["--config-dir", str(tmp_path / "conf"), "optim=adagrad", *FAST]
        + ["trainer.max_steps=30", "dist.world_size=2", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert saved["optim"] == {"_target_": "torch.optim.Adagrad", "lr": 0.05, "lr_decay": 0.001}
    assert (run_dir / "summary.json").exists()


@pytest.mark.parametrize(
    "changed",
    [
        "lr_schedule.warmup_steps=10",
        "optim=adamw",
        "trainer.precision=bf16-mixed",
        "trainer.accumulate_grad_batches=2",
        "trainer.gradient_clip_val=1.0",
    ],  # fmt: skip
)
def test_a_checkpoint_refuses_a_run_whose_recipe_or_schedule_changed(changed):
    from localsgd.config import plain
    from localsgd.loop.checkpoint import config_mismatch

    saved = {"config": plain(compose_config([]))}
    diff = config_mismatch(saved, plain(compose_config([changed])))
    assert diff is not None and diff.startswith(changed.split("=")[0].split(".")[0]), diff
    assert config_mismatch(saved, plain(compose_config(["trainer.max_steps=5000"]))) is None


def test_a_strategy_experiment_is_its_presets():
    assert compose_config(["+experiment=diloco"]) == compose_config(
        ["sync=diloco", "optim=adamw", "optim.lr=0.003"]
    )
    assert compose_config(["+experiment=adaptive_period"]) == compose_config(["sync=adaptive"])


def test_the_sparseloco_nesterov_preset_is_the_bytes_studys_row():
    """The preset README and docs/studies.md quote the study's figures for is the study's row."""
    import importlib.util

    path = os.path.join(os.path.dirname(CONF), "experiments", "lm_shakespeare", "study.py")
    spec = importlib.util.spec_from_file_location("lm_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    row = study.ROWS["sparseloco_h16_k46_sb80_n5"]
    preset = compose_config(["+experiment=sparseloco_nesterov"])
    assert preset.sync == compose_config(row).sync
    assert preset.optim == compose_config(["optim=adamw"]).optim


def test_data_and_model_are_target_nodes_whose_own_keys_come_from_one_table():
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    assert types["data"] == types["model"] == types["optim"] == "Any"  # no dict subclass
    assert tuple(f.name for f in dataclasses.fields(DataOptions)) == DATA_OPTIONS
    cfg = compose_config(["data.partition=dirichlet", "data.alpha=5", "data.num_workers=2"])
    # the schema's defaults, then the preset's own keys; the typed value (5 -> 5.0)
    assert list(cfg.data)[: 1 + len(DATA_OPTIONS)] == ["_target_", *DATA_OPTIONS]
    assert cfg.data.num_samples == 10000 and cfg.data.classes_per_worker == 2
    assert (cfg.data.partition, cfg.data.num_workers) == ("dirichlet", 2)
    assert cfg.data.alpha == 5.0 and isinstance(cfg.data.alpha, float)
    assert cfg.model == {"_target_": "localsgd.models.cnn", "channels": [32, 64],
                         "kernel_size": 5, "dropout": 0.0}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^data\.alpha must be of type float, got 'abc'$"):
        compose_config(["data.alpha=abc"])


def test_composing_and_typing_the_config_warns_of_nothing():
    """OmegaConf deprecates a structured config subclassing Dict; nothing may hide a warning."""
    assert not [f for f in warnings.filters if f[1] is not None and "Dict" in f[1].pattern]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compose_config(["data=text", "data.path=x", "model=transformer", "data.alpha=1"])


@pytest.mark.parametrize(
    "override,owner",
    [
        ("sync.schedule=x", "localsgd.loop.strategies:SCHEDULES"),
        ("sync.outer=x", "localsgd.loop.strategies:OUTERS"),
        ("sync.optimizer_state=x", "localsgd.averaging:OPTIMIZER_STATE_MODES"),
        ("sync.comm_dtype=x", "localsgd.averaging:COMM_DTYPES"),
        ("trainer.precision=x", "localsgd.loop.recipe:PRECISIONS"),
        ("trainer.nan_policy=x", "localsgd.loop.guards:NAN_POLICIES"),
        ("logger.wandb.mode=x", "localsgd.loop.loggers:WANDB_MODES"),
        ("data.partition=x", "localsgd.data.partition:PARTITIONS"),
        ("data.loader=x", "localsgd.data.loader:LOADERS"),
        ("dist.backend=x", "localsgd.config:BACKENDS"),
        ("dist.device=x", "localsgd.config:DEVICES"),
    ],  # fmt: skip
)
def test_a_refused_choice_lists_the_table_of_the_module_that_implements_it(override, owner):
    import importlib

    module, name = owner.split(":")
    table = getattr(importlib.import_module(module), name)
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([override]), world_size=4)
    assert str(refused.value) == f"{key} must be one of {', '.join(table)}, got 'x'"


def test_the_language_model_presets_optimise_the_validation_loss():
    assert compose_config([]).optimized_metric == "val_accuracy"
    for data in ("text", "shakespeare"):
        cfg = compose_config([f"data={data}", "model=transformer"])
        assert cfg.optimized_metric == "val_loss", data
        assert cfg.data.seq_len == 64 and cfg.data.partition == "iid"  # the node as before
        # periodic evaluations read a subset (the final one the whole validation set)
        assert cfg.trainer.eval_samples == 1024, data
        every = compose_config([f"data={data}", "trainer.eval_samples=null"])
        assert every.trainer.eval_samples is None, data  # the command line still wins
    # the Optuna preset names both halves of the objective: which key, and which way is better
    with open(os.path.join(CONF, "experiment", "optuna_lr.yaml")) as f:
        optuna = yaml.safe_load(f)
    assert optuna["optimized_metric"] == "val_accuracy"
    assert optuna["hydra"]["sweeper"]["direction"] == "maximize"


@pytest.mark.parametrize("preset", ["optuna_lr", "optuna_outer"])
def test_the_optuna_presets_start_tpe_after_4_random_trials(preset):
    """TPE's default of 10 random trials first would make these 12-trial sweeps a random search."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={preset}"], return_hydra_config=True)
    sampler = instantiate(cfg.hydra.sweeper.sampler)
    assert type(sampler).__name__ == "TPESampler"
    assert sampler._n_startup_trials == 4 < cfg.hydra.sweeper.n_trials


def test_every_experiment_passes_the_checks_before_the_launch(capsys):
    """`python -m localsgd.train +experiment=NAME`, as README and the docs type it, is not
    refused: the entry point's checks (the preflight's model and data included) let every
    preset through to the launch (replaced here by a note that it was reached)."""
    from localsgd.cli import train as entry

    refused = {}
    names = {n.removesuffix(".yaml") for n in os.listdir(os.path.join(CONF, "experiment"))}
    # the HF preset's checks import transformers (~7 s): tests/test_hf_cli.py runs that preset
    for name in sorted(names - {"hf_llama_shakespeare"}):
        reached = []
        with (
            mock.patch.object(sys, "argv", ["localsgd.train", f"+experiment={name}"]),
            mock.patch.object(entry, "main", lambda reached=reached: reached.append(True)),
        ):
            try:
                entry.cli()
            except SystemExit:
                refused[name] = capsys.readouterr().err.strip()
        assert reached or name in refused, name
    assert refused == {}, refused

"""Checks that need more than the config's own values: files on disk, shard sizes, checkpoints.

They run in the launching process before any worker starts (and before Hydra writes anything
into the run directory), so a mistyped command fails in one line and touches no earlier run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from localsgd.cli.checks import _get
from localsgd.cli.sharding import MUON_TARGET
from localsgd.config import ConfigError, plain
from localsgd.loop import checkpoint
from localsgd.loop.plan import SyncPlan

_probed: dict[str, int | None] = {}  # the launcher checks twice (before and inside Hydra)
_units: dict[str, list[str]] = {}  # the probed model's FSDP units (relayout.fsdp_units)
_validated: dict[str, bool] = {}  # whether the probed data has a validation split


def has_validation(cfg: Any, world_size: int) -> bool:
    """Whether the data `check_data` built for `cfg` has a validation split."""
    check_data(cfg, world_size)
    return _validated[_probe_key(cfg, world_size)]


def check_data(cfg: Any, world_size: int) -> int | None:
    """Build the dataset and the model once here, as the workers will, so that a `_target_` that
    does not import, a dataset without `num_classes`, a model whose output does not match the
    classes, or a shard smaller than a batch is refused in one line before any worker starts.

    Returns trainer.max_steps resolved from trainer.max_epochs (None when max_steps is set).
    """
    data_cfg, model_cfg = plain(_get(cfg, "data")), plain(_get(cfg, "model"))
    seed, batch = _get(cfg, "seed"), _get(cfg, "trainer.batch_size")
    epochs, fragments = _get(cfg, "trainer.max_epochs"), _get(cfg, "sync.fragments")
    key = _probe_key(cfg, world_size)
    if key not in _probed:
        blocks = _get(cfg, "dist.shard_blocks")
        muon = _get(cfg, "optim._target_") == MUON_TARGET
        _probed[key] = _probe(
            data_cfg, model_cfg, seed, batch, epochs, world_size, fragments, key, blocks, muon
        )
    return _probed[key]


def _probe_key(cfg: Any, world_size: int) -> str:
    keys = (
        "data",
        "model",
        "seed",
        "trainer.batch_size",
        "trainer.max_epochs",
        "sync.fragments",
        "dist.shard_blocks",
        "optim._target_",
    )
    return json.dumps([plain(_get(cfg, k)) for k in keys] + [world_size], sort_keys=True)


def _probe(
    data_cfg,
    model_cfg,
    seed,
    batch,
    epochs,
    world_size,
    fragments=1,
    key=None,
    blocks=None,
    muon=False,
) -> int | None:
    import torch

    from localsgd.data import input_shape_of, labels_of, load_data, shard_indices, task_of
    from localsgd.data.loader import in_memory
    from localsgd.models import build_model

    data = load_data(data_cfg, seed)
    if key is not None:
        from localsgd.data.validation import validation_of

        _validated[key] = validation_of(data) is not None
    in_memory(data.train, data_cfg.get("loader", "auto"))  # refuses memory for a non-tensor set
    labels = labels_of(data.train)
    try:
        shards = [
            len(
                shard_indices(
                    labels, world_size, r, data_cfg["partition"], seed,
                    data_cfg["classes_per_worker"], data_cfg["alpha"],
                )
            )
            for r in range(world_size)
        ]  # fmt: skip
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if batch > min(shards):
        raise ConfigError(
            f"trainer.batch_size must be <= the smallest worker's shard ({min(shards)} samples: "
            f"{len(labels)} train samples over {world_size} workers, "
            f"data.partition={data_cfg['partition']}), got {batch}"
        )
    shape, task = input_shape_of(data), task_of(data)
    with torch.random.fork_rng(devices=[]):
        model = build_model(model_cfg, shape, data.num_classes, task)
        x, y = torch.utils.data.default_collate([data.train[0], data.train[1 % len(data.train)]])
        model.eval()
        try:
            with torch.no_grad():
                out = model(x)
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[-1]
            raise ConfigError(
                f"model._target_ {model_cfg['_target_']!r} fails on a batch of the data (input "
                f"{tuple(x.shape)}): {type(e).__name__}: {reason}"
            ) from None
    if muon:
        from localsgd.loop.muon import muon_parameters

        if not muon_parameters(model):
            raise ConfigError(
                f"optim=muon needs 2-D weight matrices besides embeddings and the output head, "
                f"and model._target_ {model_cfg['_target_']!r} has none (Muon would train "
                f"nothing); use optim=adamw, or a model with linear layers (model=mlp, "
                f"model=transformer)"
            )
    if blocks is not None:
        from localsgd.averaging.streaming.fragments import model_blocks

        try:
            model_blocks(model, blocks)
        except ValueError as e:
            raise ConfigError(f"dist.shard_blocks={blocks}: {e}") from None
    if key is not None:  # what a sharded run's checkpoint must have been written from
        from localsgd.loop.checkpoint.relayout import fsdp_units

        _units[key] = fsdp_units(model, blocks)
    if fragments > 1:  # Streaming DiLoCo strides its fragments over the model's blocks
        from localsgd.averaging.streaming.fragments import model_blocks

        blocks = len(model_blocks(model))
        if blocks < fragments:
            raise ConfigError(
                f"sync.fragments must be <= the {blocks} blocks of model._target_ "
                f"{model_cfg['_target_']!r} (fragments are strided by block), got {fragments}"
            )
    expected = (*y.shape, data.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model._target_ {model_cfg['_target_']!r} must return logits of shape {expected} "
            f"(batch, num_classes={data.num_classes}) for input {tuple(x.shape)}, got {got}"
        )
    if epochs is None:
        return None
    return int(epochs) * (min(shards) // batch)  # every rank takes the same number of steps


def resolve_resume(
    cfg: Any, world_size: int, run_dir: str | None, quiet: bool = False
) -> str | None:
    found = _find_resume(cfg, world_size, run_dir, quiet)
    if found is not None:
        marker = checkpoint.verify(found, world_size)
        config = plain(cfg)
        # a checkpoint of one worker per rank continues with any shard size, resharded on
        # load (localsgd.loop.checkpoint.reshard); a shared one (ft) with its own: the key stays
        shards = _shard_size_of(marker)
        if marker.get("shared") and shards != _get(cfg, "dist.shard_size"):
            raise ConfigError(
                f"dist.shard_size must stay {shards} to resume {found}, a shared checkpoint "
                f"(written under ft=torchft: one replica group's state, laid out for its "
                f"{shards} rank(s)), got {_get(cfg, 'dist.shard_size')}"
            )
        relaid = False
        if not marker.get("shared") and isinstance(config.get("dist"), dict):
            relaid = shards != _get(cfg, "dist.shard_size")
            config["dist"]["shard_size"] = shards
        if marker["world_size"] != world_size or relaid:
            sharded = shards > 1 or _get(cfg, "dist.shard_size") > 1
            refusal = SyncPlan.of(_get(cfg, "sync")).reshard_refusal(sharded)
            if refusal is not None:
                keys, was = "dist.world_size", str(marker["world_size"])
                if relaid:
                    keys, was = f"{keys} and dist.shard_size", f"{was} and {shards}"
                raise ConfigError(f"{keys} must stay {was} to resume {found} with {refusal}")
        diff = checkpoint.config_mismatch(marker, config)
        if diff is not None:
            raise ConfigError(
                f"trainer.resume must continue the same run, but {found} differs in {diff}; "
                f"keep those settings, or start afresh in another hydra.run.dir"
            )
        _check_units(cfg, world_size, marker, found)
    return found


def _check_units(cfg: Any, world_size: int, marker: dict, found: str) -> None:
    """A sharded run's checkpoint holds its FSDP units' keys: refuse one of other units (a
    model whose blocks or shapes changed while its config did not) in one line."""
    if "units" not in marker:
        return
    key = _probe_key(cfg, world_size)
    units = _units.get(key)
    if units is None:
        return
    for old, new in zip(marker["units"] + [None], units + [None], strict=False):
        if old != new:
            raise ConfigError(
                f"trainer.resume must name a checkpoint of this model's FSDP units, but {found} "
                f"was written with other units ({old!r} in the checkpoint, {new!r} now); start "
                f"afresh in another hydra.run.dir"
            )


def _shard_size_of(marker: dict) -> int:
    """The dist.shard_size a checkpoint was written with (1 before the key existed)."""
    if "shard_size" in marker:  # a sharded run's (checkpoint.dcp)
        return int(marker["shard_size"])
    saved = (marker.get("config") or {}).get("dist") or {}
    return int(saved.get("shard_size", checkpoint.ADDED_KEYS["dist.shard_size"]))


def _find_resume(cfg: Any, world_size: int, run_dir: str | None, quiet: bool = False) -> str | None:
    """The checkpoint folder to start from, or None to start fresh; ConfigError if the setting
    names something unusable. `run_dir` None: not known yet (only the explicit path is checked)."""
    warn = None if quiet else _warn
    resume = _get(cfg, "trainer.resume")
    if resume not in ("auto", "never"):
        path = os.path.abspath(os.path.expanduser(resume))
        if not os.path.exists(path):
            raise ConfigError(
                f"trainer.resume must be auto, never or an existing checkpoint, got {resume!r} "
                f"(no such file or directory)"
            )
        if os.path.isdir(checkpoint.checkpoint_root(path)):  # a run directory: its newest
            found = checkpoint.newest_complete(path, world_size, warn)
            if found is None:
                raise ConfigError(
                    f"trainer.resume must name a complete checkpoint; {resume} holds none"
                )
            return found
        try:
            checkpoint.verify(path, world_size)
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"trainer.resume must name a complete checkpoint; {e}") from None
        return path
    if run_dir is None:
        return None
    if resume == "never":
        if checkpoint.listed_steps(run_dir):
            raise ConfigError(
                f"trainer.resume=never but hydra.run.dir {run_dir} holds checkpoints of an "
                f"earlier run; use trainer.resume=auto or another hydra.run.dir"
            )
        return None
    found = checkpoint.newest_complete(run_dir, world_size, warn)
    if found is None and checkpoint.has_marked(run_dir):
        # Starting afresh would overwrite the earlier run's metrics and checkpoints.
        reasons: list[str] = []
        checkpoint.newest_complete(
            run_dir, world_size, lambda m: reasons.append(m.removeprefix("skipping checkpoint: "))
        )
        raise ConfigError(
            f"trainer.resume=auto found no usable checkpoint in {run_dir}: each of the "
            f"{len(reasons)} is partial or corrupt (the newest: {reasons[0]}); use another "
            f"hydra.run.dir"
        )
    return found


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)

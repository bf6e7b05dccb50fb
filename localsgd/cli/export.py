"""`python -m localsgd.export PATH [--out DIR]`: a model=hf run's model as Hugging Face loads it.

PATH is a run directory or one of its checkpoint folders (`checkpoints/step-N`):

- a finished run: its final model (`model.pt`), into `RUN_DIR/hf` (what the run itself wrote
  there; exporting again rewrites it, e.g. after deleting it);
- a run without `model.pt` (stopped, killed): its newest complete checkpoint;
- a checkpoint folder: that checkpoint, into `RUN_DIR/hf-step-N`.

A checkpoint's model is the workers' own: taken at a sync they hold the same one; taken between
syncs the export is their mean (parameters and floating-point buffers), the average the next
sync would start from. A sharded run's checkpoint (`dist.shard_size` > 1) is read from its DCP
folder in this one process, each replica group's shards joined whole, then the groups averaged.
The run's config (its checkpoint's marker, else `.hydra/config.yaml`) rebuilds the data, for the
tokenizer, and the model the state is loaded into, strictly: a state that is not this model's is
refused in one line, as is a run of another model (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

from localsgd.cli.hf_checks import HF_MODEL
from localsgd.config import ConfigError
from localsgd.loop import checkpoint


def model_state(folder: str) -> dict[str, torch.Tensor]:
    """The model of a verified checkpoint folder, whole, on the CPU (the module docstring)."""
    marker = checkpoint.verify(folder)
    if int(marker.get("shard_size", 1)) > 1:
        states = _dcp_groups(folder)
    else:
        states = [
            torch.load(os.path.join(folder, name), map_location="cpu", weights_only=True)["model"]
            for name in sorted(marker["files"])
        ]
    return _mean(states)


def _dcp_groups(folder: str) -> list[dict[str, torch.Tensor]]:
    """Each replica group's model from a sharded checkpoint's DCP save, joined in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.path.join(folder, "dcp"))
    saved = reader.read_metadata().state_dict_metadata
    groups = sorted({k.split(".", 1)[0] for k in saved if k.startswith("group")})
    states = []
    for group in groups:
        prefix = f"{group}.model."
        state = {
            key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in saved.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({group: {"model": state}}, storage_reader=reader, no_dist=True)
        states.append(state)
    return states


def _mean(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The first state with every floating-point tensor the mean over all (summed in order,
    divided once; at a sync each is the same, and so is their mean)."""
    out = {}
    for name, first in states[0].items():
        if first.is_floating_point() and len(states) > 1:
            total = first.clone()
            for other in states[1:]:
                total.add_(other[name])
            out[name] = total.div_(len(states))
        else:
            out[name] = first
    return out


def _config(run_dir: str, marker: dict | None) -> dict:
    """The run's resolved config: a checkpoint marker's, else `.hydra/config.yaml` resolved."""
    if marker is not None and isinstance(marker.get("config"), dict):
        return marker["config"]
    path = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"PATH must be a localsgd run directory, got {run_dir} (no {path})")
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    try:
        return {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("data", "model")} | {
            "seed": cfg.get("seed", 0)
        }
    except Exception as e:
        raise ConfigError(f"{path} does not resolve outside its run: {e}") from None


def locate(path: str) -> tuple[str, str | None, str]:
    """(the run directory, the checkpoint folder or None for model.pt, the default output)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(os.path.join(path, checkpoint.MARKER)):  # a checkpoint folder
        run_dir = os.path.dirname(os.path.dirname(path))
        return run_dir, path, os.path.join(run_dir, f"hf-{os.path.basename(path)}")
    if not os.path.isdir(path):
        raise ConfigError(
            f"PATH must be a run directory or a checkpoint folder, got {path} (no such directory)"
        )
    if os.path.isfile(os.path.join(path, "model.pt")):
        return path, None, os.path.join(path, "hf")
    found = checkpoint.newest_complete(path, None)
    if found is None:
        raise ConfigError(
            f"PATH must be a run directory with a model.pt or a complete checkpoint, got {path}"
        )
    return path, found, os.path.join(path, f"hf-{os.path.basename(found)}")


def export(path: str, out: str | None = None) -> str:
    """Write the model at `path` as Hugging Face loads it; returns the folder written."""
    from localsgd.data import input_shape_of, load_data, task_of
    from localsgd.models import build_model
    from localsgd.models.hf_export import write_hf

    run_dir, folder, default_out = locate(path)
    try:
        marker = checkpoint.verify(folder) if folder else None
        if folder is None:  # the run's newest checkpoint holds its resolved config
            newest = checkpoint.newest_complete(run_dir, None)
            marker = checkpoint.verify(newest) if newest else None
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"PATH must hold a complete checkpoint: {e}") from None
    config = _config(run_dir, marker)
    model_cfg = config.get("model") or {}
    if model_cfg.get("_target_") != HF_MODEL:
        raise ConfigError(
            f"PATH must be a run of model=hf (model._target_: {HF_MODEL}), got a run of "
            f"{model_cfg.get('_target_')!r}: only Hugging Face models export to its format"
        )
    try:
        if folder:
            state = model_state(folder)
        else:
            file = os.path.join(run_dir, "model.pt")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a file cut short or not torch's
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"PATH must hold a readable model: {reason}") from None
    data = load_data(config["data"], seed=config.get("seed", 0))
    with torch.random.fork_rng(devices=[]):
        model = build_model(model_cfg, input_shape_of(data), data.num_classes, task_of(data))
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0]
        raise ConfigError(f"PATH holds a state this run's model does not take: {reason}") from None
    return write_hf(model, data, out or default_out, state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localsgd.export",
        description="Write a model=hf run's model (a finished run's, or a checkpoint's) as "
        "Hugging Face's from_pretrained loads it, with its tokenizer.",
    )
    parser.add_argument("path", help="a run directory, or a checkpoint folder checkpoints/step-N")
    parser.add_argument(
        "--out", help="the folder to write (default: RUN_DIR/hf, RUN_DIR/hf-step-N for a "
        "checkpoint)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        written = export(args.path, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"hf: {written}")
    return 0

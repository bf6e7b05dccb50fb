"""`localsgd.load(run_dir)` (this module: `localsgd.loading`): a finished run's model, in one call.

The model is built from the run's own config (`.hydra/config.yaml`: its `model` node, and the
data's input shape, number of classes and task, which `summary.json` records as `model_inputs`;
a run made before that key existed builds its dataset once to read them) and loaded with the
run's final weights (`model.pt`) or, with `best=True`, the best ones `trainer.keep_best` kept
(`best.pt`). A model of your own (`--config-dir`) must be importable, as it was for the run.
"""

from __future__ import annotations

import json
import os

import torch

from localsgd.config import ConfigError


def model_inputs(run_dir: str, config) -> dict:
    """What building the run's model needs of its data: input_shape, num_classes, task."""
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            inputs = json.load(f).get("model_inputs")
        if inputs is not None:
            return inputs
    from omegaconf import OmegaConf

    from localsgd.data import input_shape_of, load_data, task_of

    data = load_data(OmegaConf.to_container(config.data, resolve=True), int(config.seed))
    shape = list(input_shape_of(data))
    return {"input_shape": shape, "num_classes": data.num_classes, "task": task_of(data)}


def load(run_dir: str, best: bool = False, map_location: str | torch.device = "cpu"):
    """The model of the run in `run_dir`, with its final weights (`best`: the best kept by
    `trainer.keep_best`), in eval mode, on `map_location`."""
    from omegaconf import OmegaConf

    from localsgd.models import build_model

    config_file = os.path.join(run_dir, ".hydra", "config.yaml")
    if not os.path.isfile(config_file):
        raise ConfigError(f"{run_dir} is no run directory: it has no .hydra/config.yaml")
    weights = os.path.join(run_dir, "best.pt" if best else "model.pt")
    if not os.path.isfile(weights):
        why = (
            "trainer.keep_best was off, or no evaluation ran"
            if best
            else "the run has not finished (resume it: docs/reliability.md)"
        )
        raise ConfigError(f"{run_dir} has no {os.path.basename(weights)}: {why}")
    config = OmegaConf.load(config_file)
    inputs = model_inputs(run_dir, config)
    model = build_model(
        OmegaConf.to_container(config.model, resolve=True),
        inputs["input_shape"],
        inputs["num_classes"],
        inputs.get("task", "classification"),
    )
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model.to(map_location).eval()

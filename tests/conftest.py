from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import localsgd.train  # noqa: F401  (registers the config schema)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")


def compose_config(overrides: list[str]) -> dict:
    """The resolved config dict a worker receives, composed exactly as the CLI composes it."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture
def small_config():
    return compose_config


from tests.reliability_helpers import reference_run  # noqa: E402, F401  (a session fixture)

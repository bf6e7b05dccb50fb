from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

import localsgd.train  # noqa: F401  (registers the config schema)
from localsgd.config import Config, typed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")


def compose_config(overrides: list[str]) -> Config:
    """The typed, resolved config a worker receives, composed exactly as the CLI composes it."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return typed(cfg)


@pytest.fixture
def small_config():
    return compose_config


from tests.reliability_helpers import reference_run  # noqa: E402, F401  (a session fixture)

"""One-line errors for bad command-line overrides, checked before Hydra composes anything.

Hydra refuses an unknown config-group option or a badly typed value itself, but in a multi-line
report; these checks catch the common cases first and say the key and what is allowed in one line.
"""

from __future__ import annotations

import os
from importlib import resources

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from localsgd.config import Config, ConfigError

# The package `localsgd.conf`: `conf/` of the source tree, mapped into the package by
# pyproject.toml, so the same name finds it in a checkout, an editable install and a wheel.
CONF_PACKAGE = "localsgd.conf"
CONF_DIR = str(resources.files(CONF_PACKAGE))


def group_options(group: str) -> list[str]:
    folder = os.path.join(CONF_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def _values(override) -> list:
    if override.is_sweep_override():
        return list(override.sweep_iterator())
    return [override.value()]


def check_overrides(args: list[str]) -> None:
    """Raise ConfigError for the first override naming a missing group option or a bad value."""
    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except HydraException as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    schema = OmegaConf.structured(Config)
    for o in overrides:
        key = o.key_or_group
        if key.startswith("hydra") or o.is_delete():
            continue
        if os.path.isdir(os.path.join(CONF_DIR, key)):
            allowed = group_options(key)
            for value in _values(o):
                if str(value) not in allowed:
                    raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
            continue
        if OmegaConf.select(schema, key, default="<missing>") == "<missing>" and o.is_add():
            continue  # `+key=value` adds a new key; Hydra handles it
        for value in _values(o):
            try:
                OmegaConf.update(schema, key, value, merge=True)
            except (OmegaConfBaseException, ValueError) as e:
                if OmegaConf.select(schema, key, default="<missing>") == "<missing>":
                    raise ConfigError(f"{key} is not a setting (see conf/config.yaml)") from None
                node = OmegaConf.select(schema, key)
                kind = type(node).__name__ if node is not None else "a valid value"
                raise ConfigError(f"{key} must be of type {kind}, got {value!r}") from e

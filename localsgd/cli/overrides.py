"""One-line errors for bad command-line overrides, checked before Hydra composes anything.

Hydra refuses an unknown config-group option or a badly typed value itself, but in a multi-line
report; these checks catch the common cases first and say the key and what is allowed in one line.
"""

from __future__ import annotations

import os
import re
from importlib import resources

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from localsgd.config import DATA_OPTIONS, Config, ConfigError, data_options

# The package `localsgd.conf`: `conf/` of the source tree, mapped into the package by
# pyproject.toml, so the same name finds it in a checkout, an editable install and a wheel.
CONF_PACKAGE = "localsgd.conf"
CONF_DIR = str(resources.files(CONF_PACKAGE))


def split_config_dirs(args: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's `--config-dir DIR` / `-cd DIR` (also `--config-dir=DIR`): (the dirs, other args)."""
    dirs, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(os.path.abspath(args[i + 1]))
            i += 2
            continue
        if arg.startswith("--config-dir="):
            dirs.append(os.path.abspath(arg.split("=", 1)[1]))
        else:
            rest.append(arg)
        i += 1
    return dirs, rest


def group_options(group: str, extra_dirs: tuple[str, ...] = ()) -> list[str]:
    """The options of config group `group`: localsgd's own and those of `--config-dir` folders."""
    found = set()
    for root in (CONF_DIR, *extra_dirs):
        folder = os.path.join(root, group)
        if os.path.isdir(folder):
            found.update(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
    return sorted(found)


def _values(override) -> list:
    if override.is_sweep_override():
        return list(override.sweep_iterator())
    return [override.value()]


def check_overrides(args: list[str]) -> None:
    """Raise ConfigError for the first override naming a missing group option or a bad value."""
    extra_dirs, args = split_config_dirs(args)
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
        if any(os.path.isdir(os.path.join(d, key)) for d in (CONF_DIR, *extra_dirs)):
            allowed = group_options(key, tuple(extra_dirs))
            for value in _values(o):
                if str(value) not in allowed:
                    raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
            continue
        if OmegaConf.select(schema, key, default="<missing>") == "<missing>" and o.is_add():
            continue  # `+key=value` adds a new key; Hydra handles it
        if key.startswith("data.") and key[len("data.") :] in DATA_OPTIONS:
            for value in _values(o):  # an open node: its schema types localsgd's own keys only
                data_options({key[len("data.") :]: value})
            continue
        for value in _values(o):
            try:
                OmegaConf.update(schema, key, value, merge=True)
            except (OmegaConfBaseException, ValueError) as e:
                if OmegaConf.select(schema, key, default="<missing>") == "<missing>":
                    raise ConfigError(f"{key} is not a setting (see localsgd/config.py)") from None
                node = OmegaConf.select(schema, key)
                kind = type(node).__name__ if node is not None else "a valid value"
                raise ConfigError(f"{key} must be of type {kind}, got {value!r}") from e


def composition_error(error: Exception) -> ConfigError:
    """Hydra's refusal of an override, as one line naming the key: a value of the wrong type
    or an unknown key inside a group preset's schema (e.g. `optim.lr=abc`, `optim.momentm=0`),
    which only composing the chosen presets can tell."""
    cause: BaseException | None = error
    while cause is not None:
        key = getattr(cause, "full_key", None)
        if key:
            if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
                group = key.split(".")[0]
                return ConfigError(
                    f"{key} is not a setting of this {group} preset (see conf/{group}/)"
                )
            if isinstance(cause, ValidationError):
                kind = re.search(r"converted to (\w+)", str(cause))
                kind = kind[1].lower() if kind else "the schema's type"
                return ConfigError(f"{key} must be of type {kind}, got {cause.value!r}")
        cause = cause.__cause__
    return ConfigError(str(error).strip().splitlines()[0])

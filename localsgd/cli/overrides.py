"""One-line errors for bad command-line overrides, checked before Hydra composes anything.

Hydra refuses an unknown config-group option or a badly typed value itself, but in a multi-line
report; these checks catch the common cases first and say the key and what is allowed in one line.
"""

from __future__ import annotations

import difflib
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

# The schema's typed nodes: every key they can hold is a field of theirs, so a key `+` adds
# there is a typo that the dataclasses would drop without a word (`+sync.peroid=4`). The open
# nodes (data, model, optim, lr_schedule) take a callable's own arguments and stay addable.
TYPED_NODES = ("sync", "trainer", "dist", "comm", "ft", "logger")
KEYS_DOC = "docs/configuration.md#every-key"


def schema_keys(node=None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema's typed nodes (`sync.period`, `comm.simulate.latency_ms`)."""
    if node is None:
        node = OmegaConf.structured(Config)
        return [k for name in TYPED_NODES for k in schema_keys(node[name], name + ".")]
    out = []
    for name in node:
        if OmegaConf.is_dict(node[name]):
            out.extend(schema_keys(node[name], f"{prefix}{name}."))
        else:
            out.append(prefix + name)
    return out


def unknown_key(key: str) -> ConfigError:
    """`key` is no setting: one line, with the nearest real key when one is close."""
    keys = schema_keys()
    parent, _, leaf = key.rpartition(".")
    # the leaf among its siblings first: on whole keys the shared `trainer.` alone looks close
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    near = [siblings[m] for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)]
    near = near or difflib.get_close_matches(key, keys, n=1, cutoff=0.8)  # `sycn.period`
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(f"{key} is not a setting{hint} (every key: {KEYS_DOC})")


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
        if key == "experiment" and not (o.is_add() or o.is_force_add()):
            # lightning-hydra-template lists `experiment: null` in its defaults; ours does not
            raise ConfigError(
                f"experiment is added with a +: +experiment={_values(o)[0]} (it is not in the "
                f"defaults list of conf/config.yaml)"
            )
        if any(os.path.isdir(os.path.join(d, key)) for d in (CONF_DIR, *extra_dirs)):
            allowed = group_options(key, tuple(extra_dirs))
            for value in _values(o):
                if str(value) not in allowed:
                    raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
            continue
        if OmegaConf.select(schema, key, default="<missing>") == "<missing>" and o.is_add():
            if key.split(".")[0] in TYPED_NODES:
                raise unknown_key(key)
            continue  # `+key=value` adds a key to an open node; Hydra handles it
        if key.startswith("data.") and key[len("data.") :] in DATA_OPTIONS:
            for value in _values(o):  # an open node: its schema types localsgd's own keys only
                data_options({key[len("data.") :]: value})
            continue
        for value in _values(o):
            try:
                OmegaConf.update(schema, key, value, merge=True)
            except (OmegaConfBaseException, ValueError) as e:
                if OmegaConf.select(schema, key, default="<missing>") == "<missing>":
                    raise unknown_key(key) from None
                node = OmegaConf.select(schema, key)
                kind = type(node).__name__ if node is not None else "a valid value"
                raise ConfigError(f"{key} must be of type {kind}, got {value!r}") from e


def experiment_presets(name: str, extra_dirs: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """An experiment file's group choices (`override /optim: adamw` -> {"optim": "adamw"}) and
    its top-level settings, read from `conf/experiment/NAME.yaml` (or a --config-dir's)."""
    for root in (*extra_dirs, CONF_DIR):
        path = os.path.join(root, "experiment", f"{name}.yaml")
        if os.path.isfile(path):
            node = OmegaConf.to_container(OmegaConf.load(path)) or {}
            groups = {}
            for entry in node.pop("defaults", None) or []:
                if isinstance(entry, dict):
                    for k, v in entry.items():
                        groups[k.removeprefix("override ").strip().lstrip("/")] = v
            return groups, node
    return {}, {}


def check_experiment_optimizer(args: list[str]) -> None:
    """`+experiment=diloco optim=sgd`: the experiment's optimizer settings (lr 0.003, chosen for
    AdamW) would be kept for another optimizer without a word. Refused unless the command also
    gives each of them, since a learning rate tuned for one optimizer is wrong for another."""
    extra_dirs, args = split_config_dirs(args)
    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except HydraException:
        return  # check_overrides says why
    chosen = {o.key_or_group: [str(v) for v in _values(o)] for o in overrides}
    given = {o.key_or_group for o in overrides}
    for name in chosen.get("experiment", []):
        groups, settings = experiment_presets(name, tuple(extra_dirs))
        kept = [k for k in (settings.get("optim") or {}) if f"optim.{k}" not in given]
        if "optim" not in groups or not kept:
            continue
        for optim in chosen.get("optim", []):
            if optim == groups["optim"]:
                continue
            theirs = ", ".join(f"optim.{k}={settings['optim'][k]}" for k in kept)
            mine = _preset_defaults(optim, kept)
            raise ConfigError(
                f"optim={optim} replaces the {groups['optim']} of +experiment={name}, whose "
                f"{theirs} was set for {groups['optim']} and would be kept for {optim}: give "
                f"{' '.join(f'optim.{k}=...' for k in kept)} for {optim} too{mine}, or leave "
                f"optim={groups['optim']}"
            )


def _preset_defaults(optim: str, keys: list[str]) -> str:
    from localsgd.config import SCHEMAS

    schema = SCHEMAS.get(("optim", f"{optim}_schema"))
    if schema is None:
        return ""
    values = [f"optim.{k}={getattr(schema, k)}" for k in keys if hasattr(schema, k)]
    return f" (the {optim} preset's own: {' '.join(values)})" if values else ""


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

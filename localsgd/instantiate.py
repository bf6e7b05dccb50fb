"""Build a config node's `_target_` with Hydra, offering it what only the run knows.

The Hydra-ecosystem convention (lightning-hydra-template, torchtune): a node names a callable in
`_target_` and holds its keyword arguments beside it. localsgd adds values the config cannot hold
(the data's `num_classes` and `input_shape` for a model, the run's `seed` for a dataset), passed
only when the callable's signature names them or takes **kwargs, so any callable works as it is.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from localsgd.config import ConfigError


def target_name(node: Mapping) -> str:
    """The callable's own name (`localsgd.models.resnet20` -> `resnet20`), for summaries."""
    return str(node.get("_target_", "")).rsplit(".", 1)[-1]


def locate(node: Mapping, key: str) -> Any:
    """The callable `node._target_` names; ConfigError (one line) when it does not import."""
    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{key}._target_ must name a callable as module.name, got {target!r}")
    hydra_log = logging.getLogger("hydra.utils")  # it logs the failure in 3 lines of its own
    level, hydra_log.disabled = hydra_log.disabled, True
    try:
        fn = get_object(target)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raised
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
        raise ConfigError(
            f"{key}._target_ must be an importable callable, got {target!r} ({reason}); "
            f"is its module on the Python path (run from its folder, or set PYTHONPATH)?"
        ) from None
    finally:
        hydra_log.disabled = level
    if not callable(fn):
        raise ConfigError(f"{key}._target_ must be callable, got {target!r} ({type(fn).__name__})")
    return fn


def accepted(fn: Any, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The items of `offered` that `fn`'s signature names, or all of them if it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def build(node: Mapping, key: str, drop: tuple[str, ...] = (), **offered: Any) -> Any:
    """`hydra.utils.instantiate(node)` without the keys in `drop` (localsgd's own), plus the
    `offered` values the callable accepts and the node does not set itself.

    Errors the callable raises come back as one line naming `key`; a ConfigError it raises (the
    built-in datasets name their own keys) passes through unchanged.
    """
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    fn = locate(node, key)
    kwargs = {k: v for k, v in node.items() if k not in drop}
    extra = {k: v for k, v in accepted(fn, offered).items() if k not in kwargs}
    kwargs.setdefault("_convert_", "all")  # plain lists and dicts, not OmegaConf containers
    try:
        return instantiate(kwargs, **extra)
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):
            raise cause from None
        reason = (str(cause).strip().splitlines() or [""])[-1]
        raise ConfigError(
            f"{key}._target_ {node['_target_']!r} failed: {type(cause).__name__}: {reason}"
        ) from None

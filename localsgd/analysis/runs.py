"""Finished runs as data: a run directory (`summary.json`, `.hydra/`, `metrics.jsonl`) or a line
of a run table (`*.jsonl`), and runs grouped by their config with the seeds pooled."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

# Keys that say nothing about what was trained: never a reason to split runs into rows.
IGNORED = ("seed", "logger.", "trainer.progress", "dist.timeout_s", "dist.backend", "dist.device")
PERIOD = "sync.period"


@dataclass
class Run:
    path: str
    summary: dict[str, Any]
    config: dict[str, Any]  # flattened: "sync.period" -> 16
    metrics: list[dict[str, Any]] = field(default_factory=list)
    # the command line's, as Hydra kept them; None for a run dir without `.hydra/overrides.yaml`
    overrides: list[str] | None = None

    @property
    def seed(self) -> Any:
        return self.config.get("seed", 0)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tuple(node) if isinstance(node, list) else node}


def load_run(path: str) -> Run:
    with open(os.path.join(path, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    config: dict[str, Any] = {}
    config_file = os.path.join(path, ".hydra", "config.yaml")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = flatten(yaml.safe_load(f) or {})
    else:  # a run without Hydra's record: what the summary says is all we know
        config = {PERIOD: summary.get("period"), "sync.warmup_steps": summary.get("warmup_steps")}
    overrides = read_overrides(path)
    for item in overrides or []:  # the overrides win where config.yaml is missing a key
        key, _, value = item.lstrip("+").partition("=")
        config.setdefault(key, yaml.safe_load(value))
    metrics = []
    metrics_file = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics_file):
        with open(metrics_file, encoding="utf-8") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    return Run(path, summary, config, metrics, overrides)


def read_overrides(path: str) -> list[str] | None:
    overrides_file = os.path.join(path, ".hydra", "overrides.yaml")
    if not os.path.isfile(overrides_file):
        return None
    with open(overrides_file, encoding="utf-8") as f:
        return [str(o) for o in yaml.safe_load(f) or []]


# What a run table keeps of each metrics record: what the tables and plots read.
CURVE_KEYS = (
    "step",
    "loss",
    "test_loss",
    "test_accuracy",
    "test_perplexity",
    "val_loss",
    "val_accuracy",
    "val_perplexity",
    "comm_rounds",
    "comm_bytes",
    "comm_seconds",
    "wall_time_s",
)


def table_row(run: Run, root: str) -> dict[str, Any]:
    """One line of a run table: the metrics as columns (a list per key, None where a record
    lacks it), so the curve costs one key name per run rather than per record."""
    keys = [k for k in CURVE_KEYS if any(k in m for m in run.metrics)]
    return {
        "run": os.path.relpath(run.path, os.path.dirname(os.path.abspath(root))),
        "overrides": run.overrides or [],
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in run.config.items()},
        "summary": run.summary,
        "curve": {k: [m.get(k) for m in run.metrics] for k in keys},
    }


def read_table(path: str) -> list[Run]:
    runs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                curve = row["curve"]
                length = max((len(v) for v in curve.values()), default=0)
                metrics = [
                    {k: v[i] for k, v in curve.items() if v[i] is not None} for i in range(length)
                ]
                config = {
                    k: tuple(v) if isinstance(v, list) else v for k, v in row["config"].items()
                }
                kept = row.get("overrides")
                overrides = None if kept is None else [str(o) for o in kept]
                runs.append(Run(row["run"], row["summary"], config, metrics, overrides))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise ValueError(f"{path}:{n}: not a run-table row ({e})") from None
    return runs


def find_runs(roots: Iterable[str]) -> list[Run]:
    runs = []
    for root in roots:
        if os.path.isfile(root) and root.endswith(".jsonl"):
            runs.extend(read_table(root))
            continue
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: no such directory or run table (.jsonl)")
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in ("wandb", ".hydra"))
            if "summary.json" in files:
                runs.append(load_run(folder))
    return runs


def _ignored(key: str) -> bool:
    return key == "seed" or key.startswith(IGNORED) or key.startswith("hydra")


def varying_keys(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between runs, seeds and bookkeeping excluded."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if not _ignored(k) and len({repr(r.config.get(k)) for r in runs}) > 1]


def _text(value: Any) -> str:
    """A config value as the command line writes it, so `sync.period=4` on one run's command
    line and 4 in another run's config compare equal."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _value(run: Run, key: str) -> str | None:
    """`key`'s value in `run`: a config key's value, or for a config group (`data`, `model`)
    the name of what it builds (`text`, `transformer`), `default` where the command line did
    not choose one; None where the run's config has no such key (a run from before the key
    existed, which says nothing about it)."""
    if key in run.config:
        return _text(run.config[key])
    target = run.config.get(f"{key}._target_")
    if target:
        return str(target).rsplit(".", 1)[-1]
    return "default" if "." not in key else None


def _part(config: dict[str, Any], key: str, value: str) -> str:
    steps = config.get("trainer.max_steps") or 1e18  # null when trainer.max_epochs is set
    period = config.get(PERIOD)
    if key == PERIOD and period is not None and period >= steps:
        return f"{key}={value} (one-shot)"
    return f"{key}={value}"


def label(config: dict[str, Any], keys: list[str]) -> str:
    """`key=value, ...` over `keys`; a config group whose `_target_` differs is named once by
    what it builds (`data=text`), not by each of its keys."""
    owners = {k.removesuffix("._target_") for k in keys if k.endswith("._target_")}
    parts = []
    for key in keys:
        owner = next((o for o in owners if key.startswith(o + ".")), None)
        if owner is None:
            parts.append(_part(config, key, _text(config.get(key))))
        elif key == owner + "._target_":
            parts.append(f"{owner}={str(config.get(key)).rsplit('.', 1)[-1]}")
    return ", ".join(parts) or "all runs"


def _override_keys(runs: list[Run]) -> list[str] | None:
    """The command-line keys whose values differ between the runs, in command-line order (a run
    with no record of its command line has them in its config); None when no run has one."""
    if all(r.overrides is None for r in runs):
        return None
    keys: dict[str, None] = {}
    for run in runs:
        for item in run.overrides or []:
            key = item.lstrip("+~").partition("=")[0]
            if not _ignored(key):
                keys[key] = None
    return [k for k in keys if len({_value(r, k) for r in runs} - {None}) > 1]


@dataclass
class Group:
    """Runs with the same config except the seed."""

    label: str
    config: dict[str, Any]
    runs: list[Run]
    parts: dict[str, str] = field(default_factory=dict)  # key -> "key=value", making the label
    baseline: str = ""  # the values most groups share, which their labels leave out

    def without(self, key: str) -> str:
        """The label less one key's part (a plot's panel, whose lines are that key's values)."""
        return ", ".join(p for k, p in self.parts.items() if k != key)

    def values(self, key: str) -> list[float]:
        return [float(r.summary[key]) for r in self.runs if r.summary.get(key) is not None]


def group_runs(runs: list[Run]) -> tuple[list[Group], list[str]]:
    """Runs whose config differs only in the seed are a group. A group's label names only what
    differs between the groups, as the command lines said it (`data=text, sync.period=64`): the
    configs alone would list every key a config group sets (hundreds of characters)."""
    keys = varying_keys(runs)
    groups: dict[tuple, Group] = {}
    for run in runs:
        ident = tuple(repr(run.config.get(k)) for k in keys)
        if ident not in groups:
            groups[ident] = Group("", run.config, [])
        groups[ident].runs.append(run)
    named = _override_keys(runs)
    for g in groups.values():
        g.parts = (
            _config_parts(g.config, keys)
            if named is None
            else {
                k: _part(g.config, k, value)
                for k in named
                if (value := _value(g.runs[0], k)) is not None
            }
        )
    baseline = _leave_out_the_usual(list(groups.values()))
    _tell_apart(list(groups.values()), keys)
    for g in groups.values():
        g.label = ", ".join(g.parts.values()) or "all runs"
        g.baseline = baseline

    def order(g: Group) -> tuple:
        rest = tuple(repr(g.config.get(k)) for k in keys if k != PERIOD)
        return rest, g.config.get(PERIOD) or 0

    return sorted(groups.values(), key=order), keys


def _leave_out_the_usual(groups: list[Group]) -> str:
    """Drop from the labels each key's value that more than half of the groups (of those that
    know the key) have: a study varying a dozen keys, one or two at a time, would otherwise name
    all of them in every row. Returns those values. Two groups that differ in a key cannot both
    have its usual value, so labels stay distinct, except where one group's runs did not know
    the key (`_tell_apart` then names them)."""
    usual: dict[str, str] = {}
    for key in {k for g in groups for k in g.parts}:
        known = [g.parts[key] for g in groups if key in g.parts]
        part, n = Counter(known).most_common(1)[0]
        if n > len(known) / 2 and len(known) > 2:
            usual[key] = part
    for g in groups:
        g.parts = {k: p for k, p in g.parts.items() if usual.get(k) != p}
    order = list(dict.fromkeys(k for g in groups for k in [*g.parts, *usual]))
    return ", ".join(usual[k] for k in order if k in usual)


def _tell_apart(groups: list[Group], keys: list[str]) -> None:
    """Groups the command lines do not tell apart (they differ in a default, or in a key that
    one run's code did not have yet) get the config keys they differ in, and failing that the
    name of their first run's directory."""
    same: dict[tuple, list[Group]] = {}
    for g in groups:
        same.setdefault(tuple(g.parts.values()), []).append(g)
    for members in same.values():
        if len(members) < 2:
            continue
        differ = [
            k
            for k in keys
            if len({repr(g.config[k]) for g in members if k in g.config}) > 1
            and all(k in g.config for g in members)
        ]
        for g in members:
            g.parts.update(_config_parts(g.config, differ))
        if len({tuple(g.parts.values()) for g in members}) < len(members):
            for g in members:
                g.parts["run"] = f"run={os.path.basename(g.runs[0].path)}"


def _config_parts(config: dict[str, Any], keys: list[str]) -> dict[str, str]:
    """`label`'s parts, one per key (a config group whose `_target_` differs: one part)."""
    owned = tuple(k.removesuffix("_target_") for k in keys if k.endswith("._target_"))
    return {
        k: label(config, [k]) for k in keys if k.endswith("._target_") or not k.startswith(owned)
    }


# Metrics where lower is better; any other (test_accuracy) is higher-is-better.
LOWER_IS_BETTER = ("loss", "perplexity", "seconds", "time", "bytes", "rounds")


def report_metric(runs: list[Run]) -> tuple[str, bool]:
    """The metric a report leads with, and whether lower is better: the runs' `optimized_metric`
    (`data=text`/`shakespeare` set val_loss, the default is val_accuracy; runs made before the
    validation split: test_*), the most common one if they differ, where their summaries have
    it."""
    named = Counter(r.config.get("optimized_metric") or "test_accuracy" for r in runs)
    for metric, _ in named.most_common():
        if any(isinstance(r.summary.get(metric), (int, float)) for r in runs):
            break
    else:
        metric = "test_accuracy"
    return metric, any(word in metric for word in LOWER_IS_BETTER)

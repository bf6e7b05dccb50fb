"""Finished runs as data: a run directory (`summary.json`, `.hydra/`, `metrics.jsonl`) or a line
of a run table (`*.jsonl`), and runs grouped by their config with the seeds pooled."""

from __future__ import annotations

import json
import os
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
    overrides_file = os.path.join(path, ".hydra", "overrides.yaml")
    if os.path.isfile(overrides_file):  # the overrides win where config.yaml is missing a key
        with open(overrides_file, encoding="utf-8") as f:
            for item in yaml.safe_load(f) or []:
                key, _, value = str(item).lstrip("+").partition("=")
                config.setdefault(key, yaml.safe_load(value))
    metrics = []
    metrics_file = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics_file):
        with open(metrics_file, encoding="utf-8") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    return Run(path, summary, config, metrics)


# What a run table keeps of each metrics record: what the tables and plots read.
CURVE_KEYS = (
    "step",
    "loss",
    "test_loss",
    "test_accuracy",
    "test_perplexity",
    "comm_rounds",
    "comm_bytes",
    "comm_seconds",
    "wall_time_s",
)


def table_row(run: Run, root: str) -> dict[str, Any]:
    """One line of a run table: the metrics as columns (a list per key, None where a record
    lacks it), so the curve costs one key name per run rather than per record."""
    overrides: list[str] = []
    overrides_file = os.path.join(run.path, ".hydra", "overrides.yaml")
    if os.path.isfile(overrides_file):
        with open(overrides_file, encoding="utf-8") as f:
            overrides = [str(o) for o in yaml.safe_load(f) or []]
    keys = [k for k in CURVE_KEYS if any(k in m for m in run.metrics)]
    return {
        "run": os.path.relpath(run.path, os.path.dirname(os.path.abspath(root))),
        "overrides": overrides,
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
                runs.append(Run(row["run"], row["summary"], config, metrics))
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


def varying_keys(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between runs, seeds and bookkeeping excluded."""
    keys = sorted({k for r in runs for k in r.config})
    out = []
    for key in keys:
        if key == "seed" or key.startswith(IGNORED) or key.startswith("hydra"):
            continue
        if len({repr(r.config.get(key)) for r in runs}) > 1:
            out.append(key)
    return out


def label(config: dict[str, Any], keys: list[str]) -> str:
    parts = []
    for key in keys:
        value = config.get(key)
        steps = config.get("trainer.max_steps") or 1e18  # null when trainer.max_epochs is set
        if key == PERIOD and value is not None and value >= steps:
            parts.append(f"{key}={value} (one-shot)")
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts) or "all runs"


@dataclass
class Group:
    """Runs with the same config except the seed."""

    label: str
    config: dict[str, Any]
    runs: list[Run]

    def values(self, key: str) -> list[float]:
        return [float(r.summary[key]) for r in self.runs if r.summary.get(key) is not None]


def group_runs(runs: list[Run]) -> tuple[list[Group], list[str]]:
    keys = varying_keys(runs)
    groups: dict[tuple, Group] = {}
    for run in runs:
        ident = tuple(repr(run.config.get(k)) for k in keys)
        if ident not in groups:
            groups[ident] = Group(label(run.config, keys), run.config, [])
        groups[ident].runs.append(run)

    def order(g: Group) -> tuple:
        rest = tuple(repr(g.config.get(k)) for k in keys if k != PERIOD)
        return rest, g.config.get(PERIOD) or 0

    return sorted(groups.values(), key=order), keys

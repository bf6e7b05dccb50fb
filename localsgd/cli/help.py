"""`--help` and `--list-experiments`: what the command does, its config groups and experiments.

Hydra's stock `--help` lists every group option, the internal `*_schema` ones too (which are
then refused), and says nothing of the experiments. This text is built from `conf/` itself: the
groups' options (their defaults marked) and each experiment's one-line summary, the first
comment line of its file that is not Hydra's `@package` line or the command that runs it.
Hydra's own help stays behind `--hydra-help`.
"""

from __future__ import annotations

import os
import textwrap

from omegaconf import OmegaConf

from localsgd.cli.overrides import CONF_DIR, group_options

# what each config group chooses, one line each (the folders of conf/ mirror the code)
GROUPS = {
    "data": "the dataset and how it is split over the workers (localsgd/data/)",
    "model": "the network (localsgd/models/)",
    "sync": "the averaging strategy: when and how the workers' models meet",
    "optim": "each worker's inner optimizer",
    "lr_schedule": "the learning rate against the step",
    "logger": "where metrics go besides metrics.jsonl",
    "ft": "fault tolerance: workers that die and come back (torchft)",
    "hydra/launcher": "where the jobs of a -m sweep run (submitit: this machine or SLURM)",
}

DOCS = (
    "README.md (start here), docs/configuration.md (every key, sweeps, data and models), "
    "docs/strategies.md, docs/reliability.md (checkpoints, resume, stops, failures), "
    "docs/metrics.md, docs/performance.md, docs/studies.md"
)
_COMMAND_PREFIXES = ("python ", "make ", "torchrun ", "@package")


def summary_line(path: str) -> str:
    """The file's first comment line that is neither Hydra's `@package` nor a command."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                continue
            text = line.lstrip("#").strip()
            if text and not text.startswith(_COMMAND_PREFIXES):
                return text
    return ""


def experiments(extra_dirs: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(name, one-line summary) of every experiment, localsgd's and those of --config-dir."""
    found: dict[str, str] = {}
    for root in (CONF_DIR, *extra_dirs):  # a --config-dir's file shadows ours
        folder = os.path.join(root, "experiment")
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".yaml"):
                    found[name[:-5]] = summary_line(os.path.join(folder, name))
    return sorted(found.items())


def _defaults() -> dict[str, str]:
    node = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF_DIR, "config.yaml")))
    return {k: v for entry in node["defaults"] if isinstance(entry, dict) for k, v in entry.items()}


def list_experiments(extra_dirs: tuple[str, ...] = ()) -> str:
    rows = experiments(extra_dirs)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {line}" for name, line in rows)


def help_text(extra_dirs: tuple[str, ...] = ()) -> str:
    defaults = _defaults()
    groups = []
    for group, meaning in GROUPS.items():
        options = group_options(group, extra_dirs)  # the files: never the *_schema nodes
        chosen = defaults.get(group)
        listed = ", ".join(f"{o}*" if o == chosen else o for o in options)
        pad = " " * 18
        groups.append(
            f"  {group:<15} {meaning}\n"
            + textwrap.fill(listed, 96, initial_indent=pad, subsequent_indent=pad)
        )
    rows = list_experiments(extra_dirs).splitlines()
    return "\n".join(
        [
            "localsgd: periodic local SGD, post-local SGD, DiLoCo and Streaming DiLoCo in PyTorch.",
            "Workers train on their own shards and average their models every few steps; the",
            "command spawns dist.world_size of them (gloo on CPU, NCCL on CUDA), or torchrun does.",
            "",
            "usage: python -m localsgd.train [GROUP=OPTION ...] [KEY=VALUE ...] [+experiment=NAME]",
            "       python -m localsgd.train -m KEY=A,B ...     a sweep: one job per combination",
            "       python -m localsgd.train --list-experiments",
            "",
            "e.g.   python -m localsgd.train +experiment=post_local_sgd sync.period=64 data=digits",
            "",
            "Config groups (GROUP=OPTION; * the default):",
            *groups,
            "",
            "Experiments (+experiment=NAME, deltas on top of the defaults; conf/experiment/):",
            *[f"  {row}" for row in rows],
            "",
            "Every key, its default and meaning: docs/configuration.md#every-key (KEY=VALUE sets",
            "one; +KEY=VALUE adds a key to data, model, optim or lr_schedule).",
            textwrap.fill(f"Docs: {DOCS}.", 96, subsequent_indent="      "),
            "Hydra's own help: --hydra-help; the composed config: --cfg job.",
        ]
    )

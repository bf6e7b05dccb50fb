"""`--help` and `--list-experiments` (localsgd/cli/help.py), in-process: a description, every
config group with its options (never the internal `*_schema` ones), every experiment with its
one-line summary, and where the docs are."""

from __future__ import annotations

import os
import re
import sys
from unittest import mock

import pytest

from localsgd.cli import train as entry
from localsgd.cli.help import GROUPS, experiments, summary_line
from localsgd.cli.overrides import group_options
from tests.helpers import CONF

pytestmark = pytest.mark.timeout(30)

EXPERIMENTS = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "experiment")))


def _output(args: list[str], capsys) -> str:
    capsys.readouterr()
    with (
        mock.patch.object(sys, "argv", ["localsgd.train", *args]),
        mock.patch.object(entry, "main", lambda: pytest.fail("Hydra was started")),
    ):
        entry.cli()  # returns: exit code 0
    return capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_groups_experiments_and_docs_without_the_schemas(flag, capsys):
    text = _output([flag], capsys)
    assert text.startswith("localsgd: periodic local SGD")
    assert "_schema" not in text and "docs/configuration.md#every-key" in text
    for group in GROUPS:
        assert f"  {group} " in text
        for option in group_options(group):
            assert option in text
    assert "mnist1d*" in text and "local_sgd*" in text  # the defaults marked
    for name, line in experiments():
        assert re.search(rf"^  {name} +{re.escape(line)}$", text, re.M), name


def test_list_experiments_gives_one_line_each(capsys):
    lines = _output(["--list-experiments"], capsys).splitlines()
    assert [line.split()[0] for line in lines] == EXPERIMENTS
    for line, (name, summary) in zip(lines, experiments(), strict=True):
        assert line.startswith(name) and line.endswith(summary)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_file_opens_with_a_whole_one_line_summary(name):
    """What --help shows of it: a sentence, not the first line of a paragraph cut short."""
    line = summary_line(os.path.join(CONF, "experiment", f"{name}.yaml"))
    assert line.endswith(".") and len(line) <= 110, line


def test_the_internal_schema_nodes_help_leaves_out_are_refused_as_options(capsys):
    from tests.helpers import refusal

    line = refusal(["optim=sgd_schema"], capsys)
    assert line == "error: optim must be one of adamw, muon, sgd, got 'sgd_schema'"

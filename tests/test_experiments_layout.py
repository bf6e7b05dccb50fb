"""experiments/ as a reader finds it: one folder per study (at most 25 entries at the top, no loose
study files), a README in each, every `experiments/...` path and `experiments.x.y` target the docs
name existing, every link in the study READMEs resolving, and the committed run tables still read
by `python -m localsgd.report`. Reads files only, in-process."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

from tests.test_docs import _broken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
MAX_ENTRIES = 25
# what may sit at the top of experiments/ besides the study folders (the index, the package
# marker that makes `experiments.bench` and the callbacks importable)
TOP_FILES = {"README.md", "__init__.py"}
# where experiments/ is named for a reader or a command: the docs, the README, the Makefile
# targets and the study READMEs themselves
NAMING = [
    os.path.join(ROOT, "README.md"),
    os.path.join(ROOT, "Makefile"),
    *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))),
    *sorted(glob.glob(os.path.join(EXPERIMENTS, "**", "README.md"), recursive=True)),
]
PATH = re.compile(r"(?<![\w.-])experiments/[\w./*{},-]*")
DOTTED = re.compile(r"(?<![\w./-])experiments(?:\.\w+)+")
# the run tables (`runs.jsonl`) `python -m localsgd.report` reads, as the index says
RUN_TABLES = ("ksweep/iid", "ksweep/by_class", "lm_shakespeare")

pytestmark = pytest.mark.timeout(60)


def _entries() -> list[str]:
    """The top of experiments/ as committed: caches and hidden files left out."""
    return sorted(n for n in os.listdir(EXPERIMENTS) if n != "__pycache__" and n[0] != ".")


def _folders() -> list[str]:
    return [n for n in _entries() if os.path.isdir(os.path.join(EXPERIMENTS, n))]


def _expand(path: str) -> list[str]:
    """`a.{md,json}` as `a.md`, `a.json` (the docs' shorthand for one study's files)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        out
        for alt in m.group(1).split(",")
        for out in _expand(path[: m.start()] + alt + path[m.end() :])
    ]


def _exists(path: str) -> bool:
    """A file or folder, a glob that matches one, or an output stem (`--out x/name`) whose
    files (`name.md`, `name.json`) exist."""
    full = os.path.join(ROOT, path.rstrip(".,"))
    return bool(glob.glob(full) or glob.glob(full + ".*"))


def _missing_paths(text: str) -> list[str]:
    return [
        raw
        for m in PATH.finditer(text)
        for raw in [m.group(0).rstrip(".,")]
        if not all(_exists(p) for p in _expand(raw))
    ]


def _top_level_names(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _missing_targets(text: str) -> list[str]:
    """`experiments.chaos.chaos_study.Chaos` (a Hydra `_target_`): the longest prefix that is
    a module file under the checkout, and the rest a name defined at its top level."""
    missing = []
    for m in DOTTED.finditer(text):
        parts = m.group(0).split(".")
        for cut in range(len(parts), 1, -1):
            base = os.path.join(ROOT, *parts[:cut])
            module = base + ".py" if os.path.isfile(base + ".py") else None
            module = module or (os.path.join(base, "__init__.py") if os.path.isdir(base) else None)
            if module:
                rest = parts[cut:]
                if rest and (not os.path.isfile(module) or rest[0] not in _top_level_names(module)):
                    missing.append(m.group(0))
                break
        else:
            missing.append(m.group(0))
    return missing


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_at_most_25_entries_at_the_top_and_no_loose_study_files():
    entries = _entries()
    assert len(entries) <= MAX_ENTRIES, f"experiments/ has {len(entries)} entries: {entries}"
    loose = [n for n in entries if n not in TOP_FILES and n not in _folders()]
    assert not loose, f"files at the top of experiments/ (give each study a folder): {loose}"


@pytest.mark.parametrize("folder", _folders())
def test_each_folder_has_a_readme(folder):
    assert os.path.isfile(os.path.join(EXPERIMENTS, folder, "README.md")), (
        f"experiments/{folder}/ has no README.md (what it measures, the command, its results, "
        "where docs/ reads it)"
    )


def test_the_index_names_every_folder():
    index = _read(os.path.join(EXPERIMENTS, "README.md"))
    unnamed = [f for f in _folders() if f"({f}/README.md)" not in index]
    assert not unnamed, f"experiments/README.md does not link {unnamed}"


@pytest.mark.parametrize("path", NAMING, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_experiments_path_named_exists(path):
    text = _read(path)
    missing = _missing_paths(text) + _missing_targets(text)
    assert not missing, f"{os.path.relpath(path, ROOT)} names what does not exist: {missing}"


@pytest.mark.parametrize(
    "path",
    sorted(glob.glob(os.path.join(EXPERIMENTS, "**", "README.md"), recursive=True)),
    ids=lambda p: os.path.relpath(p, ROOT),
)
def test_study_readme_links_resolve(path):
    broken = _broken(path)
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + ", ".join(broken)


def test_the_path_check_sees_stale_paths_and_targets():
    """The checks above pass on pages whose names they never matched: they must see them."""
    text = (
        "`python experiments/chaos_study.py` and [t](../experiments/trust_study_diloco.md), "
        "`experiments/chaos/chaos_study.{md,nope}`, `--out experiments/workers/workers_study_40k`, "
        "`experiments/bench/*.md`, `experiments/chaos/`.\n"
        "_target_:experiments.chaos.chaos_study.Chaos _target_:experiments.chaos_study.Chaos "
        "experiments.chaos.chaos_study.Gone"
    )
    assert _missing_paths(text) == [
        "experiments/chaos_study.py",
        "experiments/trust_study_diloco.md",
        "experiments/chaos/chaos_study.{md,nope}",
    ]
    assert _missing_targets(text) == [
        "experiments.chaos_study.Chaos",
        "experiments.chaos.chaos_study.Gone",
    ]
    assert sum(len(PATH.findall(_read(p))) for p in NAMING) > 100


def test_report_reads_the_committed_run_tables(tmp_path):
    """`python -m localsgd.report` on the moved k-sweep table gives the numbers its README
    shows (k = 16, iid: 0.7555 ± 0.0077 over 5 seeds), and each committed run table loads
    (lm_noniid/runs.jsonl is that study's own format, read by its study.py, not a run table)."""
    from localsgd.analysis.report import main as report_main
    from localsgd.analysis.runs import find_runs

    for folder in RUN_TABLES:
        assert len(find_runs([os.path.join(EXPERIMENTS, folder, "runs.jsonl")])) >= 30, folder
    table = os.path.join(EXPERIMENTS, "ksweep", "iid", "runs.jsonl")
    assert report_main([table, "--out", str(tmp_path), "--no-plots"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| sync.period=16 | 5 | 0.7555 ± 0.0077 |" in report
    assert "| 16 | 5 | 0.7555 ± 0.0077 |" in _read(os.path.join(EXPERIMENTS, "ksweep", "README.md"))

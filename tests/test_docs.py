"""The docs a newcomer reads: a README of at most 200 lines, no broken relative link (file or
#anchor) in README.md or docs/*.md, and no name in backticks, there or in a docstring, that the
code does not define. Reads files only: no subprocess, no import of localsgd."""

from __future__ import annotations

import ast
import builtins
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(path: str) -> list[str]:
    """The file's lines outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                out.append(CODE_SPAN.sub("``", line.rstrip("\n")))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped,
    spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(line)
            if m:
                slug = _slug(m.group(2))
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: str) -> list[str]:
    return [m.group(1) for line in _prose_lines(path) for m in LINK.finditer(line)]


def test_readme_is_at_most_200_lines():
    with open(README, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= 200, f"README.md has {n} lines; move detail to docs/"


def test_readme_activates_the_venv_before_its_first_python_command():
    """A newcomer copies the first example as written: outside the environment `make install`
    made, `python -m localsgd.train` stops with `No module named 'hydra'`."""
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("python -m localsgd"))
    assert any("source .venv/bin/activate" in line for line in lines[:first])


def test_docs_pages_exist():
    assert len(DOCS) > 1, "docs/*.md is missing"


def _broken(path: str) -> list[str]:
    """The relative links in `path` whose file or #anchor does not exist."""
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else os.path.normpath(
            os.path.join(os.path.dirname(path), file_part))  # fmt: skip
        if not os.path.exists(dest):
            broken.append(f"{target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = _broken(path)
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + ", ".join(broken)


def test_the_link_check_finds_the_links_and_reports_the_broken_ones(tmp_path):
    """The check above passes for a page whose links it never saw: it must see them."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n"
        "[ok](other.md) [ok anchor](other.md#a-code-heading) [here](#title) "
        '![img](other.md "t") [web](https://example.com/missing.md)\n'
        "[gone](missing.md) [bad anchor](other.md#nope) [bad here](#nothing)\n"
        "`[in code](missing-too.md)`\n"
        "```\n[fenced](missing-three.md)\n```\n"
    )
    assert _broken(str(page)) == [
        "missing.md (no such file)",
        "other.md#nope (no heading with that anchor)",
        "#nothing (no heading with that anchor)",
    ]
    # and the real pages hold relative links for it to check
    assert sum(not re.match(r"^[a-z][a-z0-9+.-]*:", t) for p in DOCS for t in _links(p)) > 10


def test_slug_matches_github():
    assert _slug("Overlapped averaging (`sync.overlap`)") == "overlapped-averaging-syncoverlap"
    assert _slug("Compressed averaging (`sync.comm_dtype`)") == (
        "compressed-averaging-synccomm_dtype")  # fmt: skip
    assert _slug("Stopping: Ctrl-C and SIGTERM") == "stopping-ctrl-c-and-sigterm"


# --- names: what a doc or a docstring names in backticks exists ----------------------------------

SOURCES = ("localsgd", "tests", "examples", "experiments", "conf")
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # a class's name: `RoundLog`
# CamelCase names of other libraries (torch, Hugging Face, hydra, ...) and of the papers
EXTERNAL = {
    "AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "BasicSweeper", "CCLoco",
    "DatasetDict", "GradScaler", "HierarchicalModelAverager", "ImageFolder", "Linear",
    "MixedPrecisionPolicy", "ModelAverager", "ModuleList", "PeriodicModelAverager",
    "PostLocalSGDOptimizer", "PreTrainedTokenizerFast", "PretrainedConfig", "ProcessGroup",
    "ReduceOp", "Sequential", "SparseLoCo", "TestCase", "ThreadLocalWorld", "VmHWM", "VmRSS",
}  # fmt: skip
# a name under another library's module is that library's to check
FOREIGN = {"torch", "nn", "dist", "np", "numpy", "wandb", "wandb_internal_pb2", "transformers",
           "datasets", "hydra", "omegaconf", "optuna", "submitit", "torchft"}  # fmt: skip


def _sources() -> list[str]:
    found = (glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True) for top in SOURCES)
    return sorted(p for paths in found for p in paths)


def _assigned(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []


def _bound(node: ast.AST) -> set[str]:
    """The names a module- or class-level statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    names = {n.id for t in _assigned(node) for n in ast.walk(t) if isinstance(n, ast.Name)}
    for sub in getattr(node, "body", []) + getattr(node, "orelse", []):
        if isinstance(node, ast.If | ast.Try):
            names |= _bound(sub)
    return names


class _Code:
    """What the repository's Python defines: each module's names, each class's attributes (its
    body's, and `self.x = ...` in its methods) and bases, and every class and function name."""

    def __init__(self, paths: list[str]):
        self.modules: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        self.names: set[str] = set()
        for path in paths:
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            rel = f"localsgd.{rel}" if rel.split(".")[0] == "conf" else rel  # as installed
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            self.modules[rel] = set().union(*(_bound(n) for n in tree.body))
            self.names |= self.modules[rel]
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.names.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    continue
                attrs = set().union(*(_bound(n) for n in node.body))
                attrs |= {
                    a.attr
                    for sub in ast.walk(node)
                    for t in _assigned(sub)
                    for a in ast.walk(t)
                    if isinstance(a, ast.Attribute) and getattr(a.value, "id", None) == "self"
                }
                bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                self.classes.setdefault(node.name, []).append((attrs, bases))
                self.names.add(node.name)

    def has(self, cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
        """Whether class `cls` (any class of that name) or a base has `attr`; a base from
        another library might, so it is not held against it."""
        for attrs, bases in self.classes.get(cls, []):
            if attr in attrs:
                return True
            for base in bases:
                if base not in self.classes and base not in ("object", "Protocol", "NamedTuple"):
                    return True
                if base not in seen and self.has(base, attr, seen | {cls}):
                    return True
        return False

    def problem(self, span: str) -> str | None:
        """Why the name `span` does not resolve, or None (also for what is no name)."""
        m = DOTTED.match(span.strip())
        if m is None:
            return None
        parts = m.group(1).split(".")
        if parts[0] in FOREIGN:
            return None
        if parts[0] == "localsgd":  # a module path: the longest module, then a name of it
            i = len(parts)
            while i > 1 and ".".join(parts[:i]) not in self.modules:
                i -= 1
            module = ".".join(parts[:i])
            if i < len(parts) and parts[i] not in self.modules.get(module, set()):
                return f"{module} defines no {parts[i]}"
            return None
        for k, part in enumerate(parts):  # a class, and the attribute after it
            if not CAMEL.match(part) or part in EXTERNAL or part in dir(builtins):
                continue
            if part not in self.names:
                return f"nothing defines {part}"
            if part in self.classes and k + 1 < len(parts) and not self.has(part, parts[k + 1]):
                return f"{part} has no {parts[k + 1]}"
        return None


def _doc_spans(path: str):
    fenced = False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                yield from ((i, s) for s in SPAN.findall(line))


def _docstring_spans(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            first = node.body[0].lineno if doc else 0
            for j, line in enumerate((doc or "").splitlines()):
                yield from ((first + j, s) for s in SPAN.findall(line))


def _unresolved(code: _Code, docs: list[str], sources: list[str]) -> list[str]:
    out = []
    for path, spans in [(p, _doc_spans(p)) for p in docs] + [
        (p, _docstring_spans(p)) for p in sources
    ]:
        for line, span in spans:
            why = code.problem(span)
            if why:
                out.append(f"{os.path.relpath(path, ROOT)}:{line}: `{span}` ({why})")
    return out


def test_every_name_in_backticks_exists():
    """A doc or docstring that names a class, a class's attribute or a `localsgd.` module path
    names something the code defines: the averaging core's refactor (issue 47) deleted the
    reducers (Reducer, LowPrecisionMean, overlap.DelayedMean, Fragments.exchange, the
    fragment_trust module), and the docs kept naming them."""
    sources = _sources()
    # the package's, the tests' and the examples' docstrings (the studies' scripts define names)
    read = [p for p in sources if os.path.relpath(p, ROOT).split(os.sep)[0] in SOURCES[:3]]
    unresolved = _unresolved(_Code(sources), DOCS, read)
    assert not unresolved, "names that do not exist:\n" + "\n".join(unresolved)


def test_the_name_check_finds_what_is_gone(tmp_path):
    (tmp_path / "mod.py").write_text(
        '"""`Kept.there`, `Kept.made`, `Gone`, `Kept.gone`, `localsgd.gone`, `x.Gone.y`."""\n'
        "class Kept:\n    there = 1\n\n    def __init__(self):\n        self.made = 2\n"
    )
    page = tmp_path / "page.md"
    page.write_text("`Kept(1)` and `PostLocalSGDOptimizer` and `ValueError`\n```\n`Gone`\n```\n")
    src = str(tmp_path / "mod.py")
    got = [line.split(": ", 1)[1] for line in _unresolved(_Code([src]), [str(page)], [src])]
    assert got == [
        "`Gone` (nothing defines Gone)",
        "`Kept.gone` (Kept has no gone)",
        "`localsgd.gone` (localsgd defines no gone)",
        "`x.Gone.y` (nothing defines Gone)",
    ]

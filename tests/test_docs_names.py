"""The names and paths the docs mention exist: a class, a class's attribute or a module named in
backticks in README.md, docs/*.md, experiments/*/README.md or a docstring of the package, the
tests or the examples; every dotted name under `localsgd` and every `.py` path written there or
in a comment. The averaging core's refactor (issue 47) deleted the reducers (Reducer,
LowPrecisionMean, overlap.DelayedMean, Fragments.exchange, the fragment_trust module) and moved
modules into wings (averaging/wire/, trust/, streaming/), and the docs kept naming the old ones.
Reads files with `ast` only: no subprocess, no import of localsgd."""

from __future__ import annotations

import ast
import builtins
import glob
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(
    [os.path.join(ROOT, "README.md")]
    + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    + glob.glob(os.path.join(ROOT, "experiments", "**", "README.md"), recursive=True)
)

SOURCES = ("localsgd", "tests", "examples", "experiments", "conf")
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # a class's name: `RoundLog`
CONSTANT = re.compile(r"^[A-Z][A-Z0-9]*_[A-Z0-9_]*$|^[A-Z]{4,}$")  # a table's: `RULES`
PLACEHOLDERS = {"KEY", "NAME"}
# other projects' files the docs cite (torch's tests) and a user's example
ELSEWHERE = ("torch/", "distributed_test.py", "my_project/")
# a `localsgd.` dotted name anywhere, and a path to a Python file (`averaging/rounds/wire.py`)
LOCALSGD = re.compile(r"(?<![\w./-])localsgd(?:\.\w+)+")
PY_PATH = re.compile(r"(?<![\w./:-])((?:[\w-]+/)*[\w-]+\.py)\b")
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

    def __init__(self, paths: list[str], root: str = ROOT):
        self.modules: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}
        self.names: set[str] = set()
        for path in paths:
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
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

    def module_names(self, dotted: str) -> str | None:
        """Why a dotted name under `localsgd` does not resolve (the longest module, then a name
        it binds)."""
        parts = dotted.split(".")
        i = len(parts)
        while i > 1 and ".".join(parts[:i]) not in self.modules:
            i -= 1
        module = ".".join(parts[:i])
        if i < len(parts) and parts[i] not in self.modules.get(module, set()):
            return f"{module} defines no {parts[i]}"
        return None

    def relative(self, parts: list[str]) -> str | None:
        """Why a module's name, then a class or a table of it, does not resolve, the module
        named by its last parts (`rounds.combine.Gathered`, `robust.RULES`); None where the
        first part names no module of the package, or what follows is no class or table
        (`trainer.max_steps` is a config key)."""
        for k in range(len(parts) - 1, 0, -1):
            suffix = ".".join(parts[:k])
            modules = [m for m in self.modules if m.startswith("localsgd.")
                       and (m == f"localsgd.{suffix}" or m.endswith(f".{suffix}"))]  # fmt: skip
            if modules:
                break
        else:
            return None
        name = parts[k]
        if not (CAMEL.match(name) or CONSTANT.match(name)) or name in PLACEHOLDERS:
            return None
        if not any(name in self.modules[m] for m in modules):
            return f"{' or '.join(modules)} defines no {name}"
        if name in self.classes and k + 1 < len(parts) and not self.has(name, parts[k + 1]):
            return f"{name} has no {parts[k + 1]}"
        return None

    def problem(self, span: str) -> str | None:
        """Why the name `span` does not resolve, or None (also for what is no name)."""
        m = DOTTED.match(span.strip())
        if m is None:
            return None
        parts = m.group(1).split(".")
        if parts[0] in FOREIGN:
            return None
        if parts[0] == "localsgd":  # read on every line, in or out of backticks (_unresolved)
            return None
        why = self.relative(parts) if len(parts) > 1 else None
        if why:
            return why
        for k, part in enumerate(parts):  # a class, and the attribute after it
            if not CAMEL.match(part) or part in EXTERNAL or part in dir(builtins):
                continue
            if part not in self.names:
                return f"nothing defines {part}"
            if part in self.classes and k + 1 < len(parts) and not self.has(part, parts[k + 1]):
                return f"{part} has no {parts[k + 1]}"
        return None


class _Files:
    """The repository's files and folders, to resolve a path written relative to the root or to
    any folder (`averaging/rounds/wire.py`, `rounds/wire.py`, `wire.py`)."""

    def __init__(self, root: str):
        self.paths: set[str] = set()
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "outputs")]
            rel = os.path.relpath(folder, root).replace(os.sep, "/")
            self.paths |= {f if rel == "." else f"{rel}/{f}" for f in files}

    def problem(self, path: str) -> str | None:
        if path.startswith(ELSEWHERE) or path in self.paths:
            return None
        return None if any(p.endswith(f"/{path}") for p in self.paths) else "no such file"


def _doc_spans(path: str):
    """The backticked spans of a Markdown file, outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                yield from ((i, s) for s in SPAN.findall(line))


def _docstrings(path: str):
    """(line, text) for each line of each docstring of a Python file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            first = node.body[0].lineno if doc else 0
            for j, line in enumerate((doc or "").splitlines()):
                yield first + j, line


def _comments(path: str):
    with open(path, encoding="utf-8") as f:
        for tok in tokenize.generate_tokens(io.StringIO(f.read()).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string


def _text(path: str):
    """(line, text) where a file mentions names and paths: a Markdown file's every line (code
    blocks too: their commands name modules), a Python file's docstrings and comments."""
    if path.endswith(".md"):
        with open(path, encoding="utf-8") as f:
            yield from enumerate(f, 1)
    else:
        yield from _docstrings(path)
        yield from _comments(path)


def _unresolved(code: _Code, files: _Files, docs: list[str], sources: list[str]) -> list[str]:
    out = []
    for path in docs + sources:
        found = []
        spans = _doc_spans(path) if path.endswith(".md") else (
            (i, s) for i, line in _docstrings(path) for s in SPAN.findall(line))  # fmt: skip
        found += [(i, f"`{s}`", code.problem(s)) for i, s in spans]
        for i, line in _text(path):
            found += [(i, m, code.module_names(m)) for m in LOCALSGD.findall(line)]
            found += [(i, m, files.problem(m)) for m in PY_PATH.findall(line)]
        rel = os.path.relpath(path, ROOT)
        out += [f"{rel}:{i}: {what} ({why})" for i, what, why in sorted(set(found)) if why]
    return out


def _read() -> list[str]:
    """The package's, the tests' and the examples' Python files (the studies' scripts are read
    for the names they define, and their READMEs as docs)."""
    return [p for p in _sources() if os.path.relpath(p, ROOT).split(os.sep)[0] in SOURCES[:3]]


def test_every_name_and_path_named_exists():
    unresolved = _unresolved(_Code(_sources()), _Files(ROOT), DOCS, _read())
    assert not unresolved, "names and paths that do not exist:\n" + "\n".join(unresolved)


def test_the_check_finds_what_is_gone(tmp_path):
    (tmp_path / "localsgd" / "wire").mkdir(parents=True)
    for package in ("localsgd", "localsgd/wire"):
        (tmp_path / package / "__init__.py").write_text("")
    mod = tmp_path / "localsgd" / "wire" / "codec.py"
    mod.write_text(
        '"""`Kept.there`, `Kept.made`, `Gone`, `Kept.gone`, `localsgd.gone`, `x.Gone.y`,\n'
        "`codec.RULES`, `wire.codec.GONE_TOO`, `codec.Kept.gone`, `trainer.max_steps`.\n"
        'localsgd.wire.codec.Kept and localsgd.wire.codec.Lost; wire/codec.py, wire/lost.py."""\n'
        "RULES = {}\n\n\n"
        "class Kept:\n    there = 1\n\n    def __init__(self):\n        self.made = 2  # old.py\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "`Kept(1)`, `PostLocalSGDOptimizer`, `ValueError`, `codec.py`\n"
        "```\n`Gone`\npython -m localsgd.wire.gone_module\n```\n"
    )
    src = str(tmp_path / "localsgd" / "wire" / "codec.py")
    python = glob.glob(os.path.join(tmp_path, "localsgd", "**", "*.py"), recursive=True)
    code, files = _Code(python, root=str(tmp_path)), _Files(str(tmp_path))
    got = [line.split(": ", 1)[1] for line in _unresolved(code, files, [str(page)], [src])]
    assert got == [
        "localsgd.wire.gone_module (localsgd.wire defines no gone_module)",  # in a code block
        "`Gone` (nothing defines Gone)",
        "`Kept.gone` (Kept has no gone)",
        "`x.Gone.y` (nothing defines Gone)",
        "localsgd.gone (localsgd defines no gone)",
        "`codec.Kept.gone` (Kept has no gone)",
        "`wire.codec.GONE_TOO` (localsgd.wire.codec defines no GONE_TOO)",
        "localsgd.wire.codec.Lost (localsgd.wire.codec defines no Lost)",
        "wire/lost.py (no such file)",
        "old.py (no such file)",  # in a comment
    ]

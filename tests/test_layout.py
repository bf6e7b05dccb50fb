"""The house's structure, held by tests: no import cycle in the package (imports inside
functions and under TYPE_CHECKING count), the trainer holds no fault-tolerance branch, nothing in
`localsgd/loop/` below the Synchroniser reads `cfg.ft`, and the averaging core imports neither
Hydra nor wandb."""

from __future__ import annotations

import ast
import functools
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "localsgd")

pytestmark = pytest.mark.timeout(60)


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    deps = set()
    for node in ast.walk(ast.parse(_read(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("localsgd"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                deps.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name.startswith("localsgd"))
    return {d for d in deps if d in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]  # the finder finds one


def _source(*parts: str) -> str:
    return _read(os.path.join(ROOT, *parts))


def test_the_trainer_holds_no_fault_tolerance_branch():
    tree = ast.parse(_source("loop", "trainer.py"))
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"ft", "fault_tolerance", "torchft"}
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("fault_tolerance" in m or "torchft" in m for m in imported if m)


def test_only_the_synchroniser_its_builder_and_fault_tolerance_read_cfg_ft_in_the_loop():
    readers = set()
    for name in os.listdir(os.path.join(ROOT, "loop")):
        if name.endswith(".py"):
            tree = ast.parse(_source("loop", name))
            if any(isinstance(n, ast.Attribute) and n.attr == "ft" for n in ast.walk(tree)):
                readers.add(name)
    assert readers <= {"synchroniser.py", "build_sync.py", "fault_tolerance.py"}, readers


def test_the_averaging_core_imports_neither_hydra_nor_wandb():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("localsgd.averaging"):
            for node in ast.walk(ast.parse(_read(path))):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                        a.name for a in node.names]  # fmt: skip
                    for imported in names:
                        assert imported.split(".")[0] not in ("hydra", "omegaconf", "wandb"), name


def _attribute_chains(tree: ast.AST) -> set[str]:
    """Every dotted name read in `tree` (`self.cfg.sync.period` gives "self.cfg.sync.period" and
    its prefixes down to two names)."""
    out = set()
    for node in ast.walk(tree):
        parts, cur = [], node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if parts and isinstance(cur, ast.Name):
            out.add(".".join([cur.id, *reversed(parts)]))
    return out


def test_the_trainer_reads_no_sync_setting_and_never_touches_the_averager():
    """The trainer talks to the Synchroniser's public methods only: no `cfg.sync`, however the
    config is reached, no `.averager`, and no private method of the Synchroniser."""
    chains = _attribute_chains(ast.parse(_source("loop", "trainer.py")))
    assert "self.sync.after_step" in chains  # the parser sees the trainer's calls
    read_sync = {c for c in chains if ".sync." in f"{c}." and "cfg" in c.split(".sync")[0]}
    assert read_sync == set(), read_sync
    assert not {c for c in chains if "averager" in c.split(".")}
    private = {c for c in chains if c.startswith("self.sync._")}
    assert private == set(), private
    attacks = _attribute_chains(ast.parse(_source("loop", "attacks.py")))
    assert not {c for c in attacks if "averager" in c.split(".")}, attacks  # it uses the hooks


# Modules over about 400 lines, each with the reason it stays whole. A module that grows past
# the limit needs a line here (or a split); one that shrank below it loses its line.
LONG_MODULES = {
    "config.py": "the schema: one dataclass per config group, every documented key",
    "loop/trainer.py": "the loop as it reads, plus evaluation, logging and the summary",
    "averaging/torchft/rounds.py": "one round across replica groups: torchft's protocol in order",
    "cli/refusals.py": "the one table of refusals: a row per combination, each keys, why and fix",
    "averaging/asynchronous/averager.py": "one worker's side of asynchronous rounds: its phase "
    "clock and fragments, the exchange with the syncer in its three forms, and their state",
}
LIMIT = 450  # "about 400"


def test_no_module_is_over_about_400_lines_without_a_reason():
    long = {}
    for path in _modules().values():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > LIMIT:
            long[rel] = lines
    assert set(long) == set(LONG_MODULES), long


# --- checkpoints: one save skeleton, one tree helper ---------------------------------------------


class _Loop:
    """The loop's state as a checkpoint holds it: taken at a sync (a shared checkpoint must be)."""

    def state_dict(self):
        return {"in_sync": True}

    def load_state_dict(self, state):
        pass


class _Own(_Loop):
    """A component with a part of its own beside a shared checkpoint (as the averager's
    error-feedback residuals)."""

    def own_state(self):
        return {"residuals": [torch.ones(2)]}


def _recording(cls, calls: list[str]):
    """`cls` with each step of the save skeleton recorded in `calls` as it runs."""

    class Recording(cls):
        def write(self, *args):
            calls.append("write")
            return super().write(*args)

        def barrier(self):
            calls.append("barrier")
            return super().barrier()

        def marker(self, *args):
            calls.append("marker")
            return super().marker(*args)

        def publish(self, *args):
            calls.append("publish")
            return super().publish(*args)

    return Recording


@pytest.fixture
def one_process():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["PerRank", "Shared", "Sharded", "SharedSharded"])
def test_every_checkpoint_layout_is_written_by_the_one_save_skeleton(tmp_path, one_process, name):
    """`checkpoint.save` is the only way a checkpoint is written, whatever its layout: each
    writer writes, the writers meet, one marks it complete, then it is published, in that order;
    the result verifies, and a shared layout keeps each worker's own part beside it."""
    from localsgd.loop import checkpoint
    from localsgd.loop.checkpoint import layout

    calls: list[str] = []
    cls = _recording(getattr(layout, name), calls)
    sharded = name in ("Sharded", "SharedSharded")
    chosen = cls(0, 1, 1) if sharded else cls(0, 1)
    model = torch.nn.Linear(3, 2)
    components = {
        "model": checkpoint.ModuleState(model),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        "loop": _Loop(),
        "averager": _Own(),
    }
    folder = checkpoint.save(chosen, str(tmp_path), 4, components, keep=2)
    assert calls == ["write", "barrier", "marker", "publish"]
    assert folder == checkpoint.step_dir(str(tmp_path), 4)
    marker = checkpoint.verify(folder)
    assert bool(marker.get("shared")) == chosen.shared and ("dcp_files" in marker) == sharded
    own = os.path.join(checkpoint.own_dir(str(tmp_path), 4), "rank-0.pt")
    assert os.path.exists(own) == chosen.shared
    calls.clear()  # a shared checkpoint another worker writes: this one keeps only its own
    assert checkpoint.save(chosen, str(tmp_path), 8, components, keep=2, writes=False) == ""
    assert calls == [] and checkpoint.listed_steps(str(tmp_path)) == [4]


@functools.cache
def _parsed() -> dict[str, ast.Module]:
    return {module: ast.parse(_read(path)) for module, path in _modules().items()}


def _calls_of(tree: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
        for n in ast.walk(tree)
    )


def _functions(tree: ast.Module):
    """The module's functions and methods (nested ones count as part of theirs)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, ast.FunctionDef))


def test_only_the_save_skeleton_marks_a_checkpoint_and_only_layouts_meet():
    """The marker is written in one place (`layout.save`), and the checkpoint package meets the
    other ranks (`barrier`) only in its layouts."""
    markers, barriers = set(), set()
    for module, tree in _parsed().items():
        for fn in _functions(tree):
            if _calls_of(fn, "write_marker"):
                markers.add(f"{module}.{fn.name}")
            if module.startswith("localsgd.loop.checkpoint") and _calls_of(fn, "barrier"):
                barriers.add(module)
    assert markers == {"localsgd.loop.checkpoint.layout.save"}
    assert barriers == {"localsgd.loop.checkpoint.layout"}


_TREE_KINDS = {"dict", "list", "tuple"}


def _tree_walkers(tree: ast.Module) -> list[str]:
    """Functions that walk trees of tensors: recursive, with a check for a container (dict, list,
    tuple) and one for a tensor (`torch.Tensor`, `is_dtensor`)."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        kinds = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance":
                checked = n.args[1]
                for e in checked.elts if isinstance(checked, ast.Tuple) else [checked]:
                    kinds.add(getattr(e, "attr", None) or getattr(e, "id", None))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "is_dtensor":
                kinds.add("Tensor")
        if _calls_of(fn, fn.name) and kinds & _TREE_KINDS and "Tensor" in kinds:
            found.append(fn.name)
    return found


def test_trees_of_tensors_are_walked_in_one_module():
    """Cloning, summing, scaling or re-sharding state dicts is `localsgd/averaging/trees.py`'s;
    no other module writes its own walk."""
    walkers = {
        module: names for module, tree in _parsed().items() if (names := _tree_walkers(tree))
    }
    assert set(walkers) == {"localsgd.averaging.trees"}, walkers
    copy = "def _clone(t):\n    if isinstance(t, torch.Tensor):\n        return t.clone()\n"
    copy += "    if isinstance(t, dict):\n        return {k: _clone(v) for k, v in t.items()}\n"
    assert _tree_walkers(ast.parse(copy)) == ["_clone"]  # the finder finds one


WINGS = {"rounds", "wire", "trust", "streaming", "torchft", "asynchronous"}


def test_the_averaging_core_is_a_folder_of_wings_each_mapped_by_its_docstring():
    """`averaging/` holds the core's modules and one folder per wing; each wing's docstring names
    every module in it (so the map a reader starts from stays true)."""
    folder = os.path.join(ROOT, "averaging")
    packages = {
        n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, "__init__.py"))
    }
    assert packages == WINGS, packages
    for wing in WINGS:
        path = os.path.join(folder, wing)
        doc = ast.get_docstring(ast.parse(_source("averaging", wing, "__init__.py"))) or ""
        modules = {n[:-3] for n in os.listdir(path) if n.endswith(".py") and n != "__init__.py"}
        unnamed = {m for m in modules if f"`{m}" not in doc}
        assert not unnamed, (wing, unnamed)


# The modules that drive the averager (the Synchroniser, its builder, the plan's strategies, the
# two round drivers) and its own checkpoint entry; anything else only calls its public methods.
DRIVES_THE_AVERAGER = {
    "loop/synchroniser.py",
    "loop/build_sync.py",
    "loop/strategies.py",
    "loop/plan.py",
    "loop/local_rounds.py",
    "loop/fault_tolerance.py",
    "loop/async_sessions.py",  # the round driver of asynchronous rounds under ft=torchft
    "loop/checkpoint/averager_state.py",
}


def test_nothing_outside_the_synchroniser_and_the_plan_touches_the_averagers_attributes():
    import inspect

    from localsgd.averaging import Averager

    methods = {n for n, v in inspect.getmembers(Averager) if callable(v) and n[0] != "_"}
    reached = {}
    for path in _modules().values():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.startswith("averaging/") or rel in DRIVES_THE_AVERAGER:
            continue
        for chain in _attribute_chains(ast.parse(_read(path))):
            parts = chain.split(".")
            if "averager" in parts[:-1]:
                after = parts[parts.index("averager") + 1 :]
                if len(after) > 1 or after[0] not in methods:
                    reached.setdefault(rel, set()).add(chain)
    assert reached == {}, reached
    assert "held_bytes" in methods  # what loop/fsdp.py's state_bytes calls

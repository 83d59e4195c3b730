"""The package's structure as rules a change cannot break silently.

Why it exists: the rooms of docs/contracts.md (planning is pure, the runtime executes plans,
nothing in the engine reaches into the training loop) only hold while something checks
them. The import graph is read with ast from the source (every import, also those inside
functions), so the check needs no torch and sees lazy imports too.
"""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dcp_ext", os.path.join("megatron", "training"))
MAX_TOP_LEVEL = 8
# what the runtime may take from planning: the plan contract and the layout vocabulary
RUNTIME_MAY_IMPORT = ("dcp_ext.planning.plan", "dcp_ext.planning.layout")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def source_files():
    for pkg in PACKAGES:
        for base, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(base, f)


def is_module(name: str) -> bool:
    base = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(base + ".py") or os.path.isdir(base) or bool(glob.glob(base + ".*.so"))


def imports_of(path: str) -> set[str]:
    """Every module path named by an import in the file (absolute, relative resolved)."""
    me = module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:  # `from pkg import module` names the module, else pkg itself
                out.add(f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}") else mod)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = {module_name(p): p for p in source_files()}
    edges = {}
    for name, path in mods.items():
        edges[name] = {m for m in imports_of(path) if m in mods and m != name}
    return mods, edges


def in_room(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def test_no_import_cycle(graph):
    _, edges = graph
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == "open":
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, cycles


def test_planning_imports_neither_torch_nor_the_runtime(graph):
    mods, _ = graph
    bad = []
    for name, path in mods.items():
        if in_room(name, "dcp_ext.planning"):
            for m in imports_of(path):
                if in_room(m, "torch") or in_room(m, "dcp_ext.runtime") or in_room(m, "megatron"):
                    bad.append(f"{name} imports {m}")
    assert not bad, bad


def test_runtime_takes_only_the_plan_contract_and_vocabulary_from_planning(graph):
    mods, _ = graph
    bad = []
    for name, path in mods.items():
        if in_room(name, "dcp_ext.runtime"):
            for m in imports_of(path):
                if in_room(m, "dcp_ext.planning") and m != "dcp_ext.planning" and not any(in_room(m, ok) for ok in RUNTIME_MAY_IMPORT):
                    bad.append(f"{name} imports {m}")
    assert not bad, bad


def test_nothing_in_dcp_ext_imports_the_training_loop(graph):
    mods, _ = graph
    bad = [f"{n} imports {m}" for n, p in mods.items() if in_room(n, "dcp_ext")
           for m in imports_of(p) if in_room(m, "megatron.training")]
    assert not bad, bad


def test_at_most_eight_modules_at_the_top_of_dcp_ext():
    top = sorted(e for e in os.listdir(os.path.join(ROOT, "dcp_ext"))
                 if e != "__pycache__" and (e.endswith(".py") or os.path.isdir(os.path.join(ROOT, "dcp_ext", e))))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_checks_see_what_they_check(tmp_path):
    """The reader resolves relative imports and sees imports inside functions."""
    pkg = tmp_path / "dcp_ext" / "planning"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    (pkg / "plan.py").write_text("")
    (tmp_path / "dcp_ext" / "runtime").mkdir()
    (tmp_path / "dcp_ext" / "runtime" / "engine.py").write_text("")
    f.write_text("from . import plan\nfrom ..runtime import engine\ndef g():\n    import torch\n")
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        got = imports_of(str(f))
    finally:
        ROOT = old
    assert {"dcp_ext.planning.plan", "dcp_ext.runtime.engine", "torch"} <= got

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def private_names_defined(path: str) -> set[str]:
    """Every `_name` a module defines: top-level functions, classes and assignments, the
    methods of its classes and the attributes they set on `self`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    out.add(t.id)
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_reaches(path: str, ours: dict[str, set[str]]) -> list[str]:
    """Where a module takes a private name another of our modules defines (and it does not):
    `from mod import _x` or `obj._x` on anything but self, cls or super(). A package may
    import its own private submodule (a compiled extension: `from dcp_ext.kernels import _kernels`)."""
    me = module_name(path)
    package = me if os.path.basename(path) == "__init__.py" else me.rpartition(".")[0]
    mine = ours.get(me, set())
    elsewhere = set().union(*(names for name, names in ours.items() if name != me)) - mine
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                own_package = is_module(f"{node.module}.{a.name}") and package == node.module
                if private and not own_package and (node.module in ours or is_module(f"{node.module}.{a.name}")):
                    bad.append(f"{me}:{node.lineno} imports {node.module}.{a.name}")
        elif isinstance(node, ast.Attribute) and node.attr in elsewhere:
            v = node.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            bad.append(f"{me}:{node.lineno} reaches {ast.unparse(node)}")
    return sorted(bad, key=lambda b: int(b.split(":")[1].split()[0]))


def test_no_module_reaches_into_another_modules_private_names(graph):
    mods, _ = graph
    ours = {name: private_names_defined(path) for name, path in mods.items()}
    bad = [b for path in mods.values() for b in private_reaches(path, ours)]
    assert not bad, bad


def test_the_private_name_check_sees_what_it_checks(tmp_path):
    """A private method called from another module, a private function imported and a private
    attribute read off an object are caught; self, super() and same-module use are not."""
    pkg = tmp_path / "dcp_ext" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("class A:\n    def _hidden(self):\n        self._x = 1\n        return self._x\n"
                              "    def ok(self, other):\n        return other._hidden()\n"
                              "def _helper():\n    pass\n")
    (pkg / "b.py").write_text("from dcp_ext.runtime.a import _helper\n"
                              "def f(a):\n    a._hidden()\n    return a._x\n"
                              "class B:\n    def g(self):\n        return super()._hidden()\n")
    global ROOT
    old, ROOT = ROOT, str(tmp_path)
    try:
        paths = {module_name(str(p)): str(p) for p in (pkg / "a.py", pkg / "b.py")}
        ours = {name: private_names_defined(p) for name, p in paths.items()}
        found = {name: private_reaches(p, ours) for name, p in paths.items()}
    finally:
        ROOT = old
    assert found["dcp_ext.runtime.a"] == []
    assert found["dcp_ext.runtime.b"] == ["dcp_ext.runtime.b:1 imports dcp_ext.runtime.a._helper",
                                          "dcp_ext.runtime.b:3 reaches a._hidden",
                                          "dcp_ext.runtime.b:4 reaches a._x"]


def test_the_engine_reads_as_the_step_it_runs():
    """The engine builds its owners and runs the step: no bigger than the step needs."""
    with open(os.path.join(ROOT, "dcp_ext", "runtime", "engine.py")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, len(lines)

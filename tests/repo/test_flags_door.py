"""Nothing below the flags' door reads the argparse namespace (issue 39).

Why it exists: the door turns the checked flags, once, into frozen records their consumers
own (`CheckpointConfig`, `LoopConfig`, `StaticOptions`, `StepOptions`, `EngineOptions`,
`PlannerConfig`, `ModelSpec`, ...). A module below it that reads `args` again would bring back
the coupling: every consumer reading any flag, defaults guessed with getattr, rules written
twice. Read with ast, so it needs no torch.
"""
import ast
import os

from tests.repo.test_structure import ROOT, source_files

# The door: the parser and its checks (the flags package, `arguments`; `flags/job_agreement`
# checks the ranks were given the same flags), the builders of the records (`flags/records`,
# `flags/core_configs`, `adaptive/run_config`), upstream's `get_args()` store and the tokenizer
# that pads the vocabulary onto the namespace (`global_vars`), and `pretrain()` (`training`),
# which parses the line and hands each part its record.
DOOR = ("megatron/training/flags/", "megatron/training/arguments.py", "megatron/training/adaptive/run_config.py",
        "megatron/training/global_vars.py", "megatron/training/training.py")
# command-line tools: their own parsers, above the door (`adaptive/profiling`: dcp-profile's entry,
# which parses Megatron's flags for the profiler)
TOOLS = ("dcp_ext/cli/", "dcp_ext/data/preprocess.py", "dcp_ext/data/preprocess_partitions.py",
         "dcp_ext/data/stats_report.py", "megatron/training/adaptive/profiling.py")


def _is_namespace(node) -> bool:
    """`args`, or `self.args` (a class that kept the namespace)."""
    if isinstance(node, ast.Name):
        return node.id == "args"
    return (isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def namespace_reads(source: str) -> list[str]:
    """Where a module takes the namespace (a parameter named `args`), reads a flag off it
    (`args.X`, `self.args.X`, getattr/vars) or asks for it (`get_args()`), in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(p.arg == "args" for p in params):
                found.append((node.lineno, f"{getattr(node, 'name', 'lambda')}(args)"))
        elif isinstance(node, ast.Attribute) and _is_namespace(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            called = getattr(node.func, "id", getattr(node.func, "attr", None))
            if called == "get_args":
                found.append((node.lineno, "get_args()"))
            elif called in ("getattr", "hasattr", "setattr", "vars") and node.args and _is_namespace(node.args[0]):
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def below_the_door() -> dict[str, list[str]]:
    out = {}
    for path in source_files():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.startswith(DOOR) or rel.startswith(TOOLS):
            continue
        with open(path) as f:
            reads = namespace_reads(f.read())
        if reads:
            out[rel] = reads
    return out


def test_the_checker_sees_each_way_of_reading_the_namespace():
    src = ("def f(args):\n    return args.lr\nclass C:\n    def g(self):\n        return self.args.seed\n"
           "h = get_args()\ni = getattr(x, 'seed', 0) or getattr(args, 'seed', 0)\nj = vars(self.args)\n"
           "def passes(args):\n    return door(args)\n")
    assert [r.split(": ")[1] for r in namespace_reads(src)] == [
        "f(args)", "args.lr", "self.args.seed", "get_args()", "getattr(args, 'seed', 0)", "vars(self.args)",
        "passes(args)"]
    # *args, or an object keeping its constructor's positional arguments, is not the namespace
    assert namespace_reads("class S:\n    def __init__(self, *args):\n        self.args = args\n"
                           "    def __repr__(self):\n        return repr(self.args)\n") == []


def test_nothing_below_the_door_reads_the_namespace():
    reading = {rel: reads[:3] for rel, reads in below_the_door().items()}
    assert not reading, f"below the door, take a record built at the door instead of args: {reading}"


def test_the_door_is_where_the_flags_are_read():
    """The check is not vacuous: the door's own modules do read the namespace."""
    with open(os.path.join(ROOT, "megatron", "training", "flags", "records.py")) as f:
        assert len(namespace_reads(f.read())) > 50

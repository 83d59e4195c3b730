"""Nothing below the flags' door reads the argparse namespace (issue 39).

Why it exists: the door (the flags package, `arguments`, `adaptive/run_config`, and `pretrain()`
that calls them) turns the checked flags into frozen records their consumers own
(`CheckpointConfig`, `LoopConfig`, `StaticOptions`, `EngineOptions`, `PlannerConfig`,
`ModelSpec`, ...). A module below it that takes `args` again would bring back the
coupling: every consumer reading any flag, defaults guessed with getattr, rules written
twice. Read with ast, so it needs no torch.

Rooms already clean must stay so. The modules that still read the namespace are listed in
`STILL_READING`: a module may leave the list (the test says when one has, so the list
shrinks with the code), none may join it.
"""
import ast
import os

from tests.repo.test_structure import ROOT, source_files

# the door: the parser and its checks, the builders of the records, and `pretrain()` (training.py),
# which parses the line and hands each part its record
DOOR = ("megatron/training/flags/", "megatron/training/arguments.py", "megatron/training/adaptive/run_config.py",
        "megatron/training/training.py")
# command-line tools: their own parsers, above the door (`adaptive/profiling`: dcp-profile's entry,
# which parses Megatron's flags for the profiler)
TOOLS = ("dcp_ext/cli/", "dcp_ext/data/preprocess.py", "dcp_ext/data/preprocess_partitions.py",
         "dcp_ext/data/stats_report.py", "megatron/training/adaptive/profiling.py")
# below the door and clean: all of dcp_ext (planning, runtime, data, kernels) but its tools, the
# checkpoints of both kinds, the loop
CLEAN_ROOMS = ("dcp_ext/", "megatron/training/checkpoint/", "megatron/training/checkpointing.py",
               "megatron/training/loop/")
STILL_READING = {
    "megatron/training/global_vars.py",
    "megatron/training/startup/job_agreement.py",
}


def _is_namespace(node) -> bool:
    """`args`, or `self.args` (a class that kept the namespace)."""
    if isinstance(node, ast.Name):
        return node.id == "args"
    return (isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def namespace_reads(source: str) -> list[str]:
    """Where a module reads a flag off the namespace (`args.X`, `self.args.X`) or asks for it
    (`get_args()`), in line order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_namespace(node.value):
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
           "h = get_args()\ni = getattr(args, 'seed', 0)\nj = vars(self.args)\n")
    assert [r.split(": ")[1] for r in namespace_reads(src)] == ["args.lr", "self.args.seed", "get_args()",
                                                                "getattr(args, 'seed', 0)", "vars(self.args)"]
    # a torch hook's positional `args` tuple, or an object keeping its constructor's, is not the namespace
    assert namespace_reads("def hook(module, args):\n    return args[0]\n") == []
    assert namespace_reads("class S:\n    def __init__(self, *args):\n        self.args = args\n"
                           "    def __repr__(self):\n        return repr(self.args)\n") == []


def test_clean_rooms_read_no_flags():
    dirty = {rel: reads[:3] for rel, reads in below_the_door().items() if rel.startswith(CLEAN_ROOMS)}
    assert not dirty, f"below the door, take a record from the door instead of args: {dirty}"


def test_no_module_starts_reading_the_namespace_and_the_list_shrinks_with_the_code():
    reading = set(below_the_door())
    new = sorted(reading - STILL_READING)
    assert not new, f"these modules read args below the door; give them a record built at the door: {new}"
    gone = sorted(STILL_READING - reading)
    assert not gone, f"these modules no longer read args: remove them from STILL_READING: {gone}"

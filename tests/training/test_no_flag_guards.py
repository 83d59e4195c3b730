"""The parsed flags are read as they are: no `getattr(args, "flag", default)` for a flag the
parser always defines.

Why it exists: a guard like that hides a misspelt flag name (the default is returned
silently) and says the namespace might lack a flag it never lacks. The training side reads
the one namespace `parse_args` builds and validates; a guard stays only for a name the
parser leaves unset unless given (upstream's table marks those) or that is not a flag.
"""
import ast
import glob
import os

from tests.conftest import TINY_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "megatron", "training", "**", "*.py"), recursive=True)) + [os.path.join(ROOT, "pretrain_gpt_dcp.py")]


def guarded_names(path: str) -> list[tuple[int, str]]:
    """(line, name) of every getattr(args, "name", default) in the file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and len(n.args) == 3
                and isinstance(n.args[0], ast.Name) and n.args[0].id == "args"
                and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            out.append((n.lineno, n.args[1].value))
    return out


def test_no_getattr_guard_for_a_flag_the_parser_always_defines():
    from megatron.training.arguments import parse_args

    always = set(vars(parse_args(TINY_MODEL + ["--train-iters", "2", "--mock-data"], world_size=1)))
    found = [f"{os.path.relpath(p, ROOT)}:{line} getattr(args, {name!r}, ...)"
             for p in FILES for line, name in guarded_names(p) if name in always]
    assert not found, found


def test_the_guard_reader_sees_guards(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(args):\n    return getattr(args, 'lr', 0.1), getattr(other, 'lr', 0), getattr(args, 'x')\n")
    assert guarded_names(str(f)) == [(2, "lr")]

"""--yaml-cfg: a YAML file whose keys are flag names, read as the parser's defaults.

Why a module of its own: a YAML value is checked and converted exactly as the same flag's
command-line value would be (type, nargs, choices, booleans), and a key given twice or an
unknown key is one line naming it. That is a job apart from defining the flags
(`arguments`); `arguments.parse_flags` calls `load_yaml_defaults` before parsing, so flags on
the command line win over the file.
"""
from __future__ import annotations

import argparse
import os

from megatron.training.flags.argument_errors import ArgumentError


def dest_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def load_yaml_defaults(parser: argparse.ArgumentParser, path: str) -> None:
    import yaml

    if os.path.isdir(path):
        raise ArgumentError(f"--yaml-cfg {path}: is a directory, not a YAML file")
    if not os.path.isfile(path):
        raise ArgumentError(f"--yaml-cfg {path}: no such file")
    try:
        with open(path) as f:
            cfg = yaml.load(f, Loader=_unique_key_loader()) or {}
    except _DuplicateKey as e:
        raise ArgumentError(f"--yaml-cfg {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--yaml-cfg {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--yaml-cfg {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(cfg, dict):
        raise ArgumentError(f"--yaml-cfg {path}: expected a mapping of flag names to values")
    actions = dest_names(parser)
    defaults, seen = {}, {}
    for key, value in cfg.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest == "yaml_cfg":
            raise ArgumentError(f"--yaml-cfg {path}: unknown key '{key}' (keys are flag names, e.g. num-layers)")
        if dest in seen:  # num-layers and num_layers are one flag
            raise ArgumentError(f"--yaml-cfg {path}: key '{key}' repeats '{seen[dest]}' (one value per flag)")
        seen[dest] = key
        defaults[dest] = _yaml_value(actions[dest], value, f"--yaml-cfg {path}: key '{key}'")
    parser.set_defaults(**defaults)


class _DuplicateKey(ValueError):
    pass


def _unique_key_loader():
    """yaml.SafeLoader that refuses a key given twice (PyYAML keeps the last one silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in keys:
                    raise _DuplicateKey(f"key '{key}' appears twice (lines {keys[key]} and "
                                        f"{key_node.start_mark.line + 1}); one value per flag")
                keys[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return Loader


def _yaml_value(action: argparse.Action, value, where: str):
    """A YAML value checked and converted like the flag's command-line value would be."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ArgumentError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value.split() if isinstance(value, str) else value
        if action.nargs != "*" and not isinstance(items, (list, dict)) and items is not None:
            items = [items]  # one value for a one-or-more flag, as on the command line
        if not isinstance(items, list):
            raise ArgumentError(f"{where}: expected a list, got {value!r}")
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise ArgumentError(f"{where}: expected {action.nargs} values, got {len(items)}")
        if action.nargs == "+" and not items:
            raise ArgumentError(f"{where}: expected at least one value")
        return [_convert(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        raise ArgumentError(f"{where}: expected one value, got {value!r}")
    return None if value is None else _convert(action, value, where)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _convert(action: argparse.Action, value, where: str):
    convert = action.type or str
    if isinstance(value, bool):  # YAML reads yes/no/on/off/true/false as booleans: never a number or a name
        raise ArgumentError(f"{where}: expected {_TYPE_NAMES.get(convert, 'a value')}, got {str(value).lower()} "
                            "(YAML reads yes/no/on/off as true/false; quote it if you mean the word)")
    try:
        out = convert(str(value))
    except (TypeError, ValueError):
        name = getattr(convert, "__name__", "value")
        raise ArgumentError(f"{where}: invalid {name} value: {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ArgumentError(f"{where}: {out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


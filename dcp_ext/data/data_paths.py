"""Where the data comes from, as upstream Megatron-LM reads its data flags.

Why a module of its own: upstream has five ways to name the data besides `--data-path`
(`get_blend_and_blend_per_split` in its training utils), and both data paths here (the
static path's GPTDataset, the `--dcp` document stream) must read them alike:

- `--data-args-path FILE`: the file holds what `--data-path` would (whitespace-separated);
- `--train-data-path`, `--valid-data-path`, `--test-data-path`: one blend per split, each in
  `--data-path`'s syntax; `--split` does not apply (every split is its datasets whole);
- `--per-split-data-args-path FILE`: a JSON object whose "train", "valid", "test" hold those
  three (a list, or one whitespace-separated string).

`resolve` turns them into one of the two forms the builders take: a blend (`--data-path`'s
list) or three per-split blends (None for a split not given). Upstream's rule decides which
when several are given: `--data-path`/`--data-args-path` win; here that is refused in one
line instead, as is any file that cannot be read or does not say what it must.
"""
from __future__ import annotations

import json
import os

from dcp_ext.data.documents import parse_blend
from dcp_ext.data.errors import DataError

SPLITS = ("train", "valid", "test")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{flag} {path} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{flag} {path}: cannot be read ({e.__class__.__name__}: {e})") from None


def _blend_from_file(path: str) -> list[str]:
    items = _read(path, "--data-args-path").split()
    if not items:
        raise DataError(f"--data-args-path {path} is empty: it should hold what --data-path would "
                        "(prefixes, optionally with weights)")
    return items


def _per_split_from_file(path: str) -> list[list[str] | None]:
    text = _read(path, "--per-split-data-args-path")
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise DataError(f"--per-split-data-args-path {path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"--per-split-data-args-path {path}: expected a JSON object with keys "
                        "\"train\", \"valid\", \"test\"")
    missing = [s for s in SPLITS if s not in obj]
    if missing:
        raise DataError(f"--per-split-data-args-path {path} has no {', '.join(repr(s) for s in missing)} "
                        "(upstream reads all three: \"train\", \"valid\", \"test\")")
    out = []
    for s in SPLITS:
        value = obj[s]
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(x, (str, int, float)) for x in value):
            raise DataError(f"--per-split-data-args-path {path}: \"{s}\" must be a list of prefixes (and weights) "
                            "or one string of them")
        out.append([str(x) for x in value] or None)
    return out


def resolve(data_path, data_args_path, train, valid, test, per_split_args_path):
    """-> (blend, per_split): `--data-path`'s list or None, and [train, valid, test] lists
    (None where not given) or None. Raises DataError for conflicting flags or bad files."""
    whole = data_path is not None or data_args_path is not None
    split_given = [x is not None for x in (train, valid, test)]
    separate = any(split_given) or per_split_args_path is not None
    if data_path is not None and data_args_path is not None:
        raise DataError("--data-path and --data-args-path exclude each other: the file holds what --data-path would")
    if whole and separate:
        one = "--data-path" if data_path is not None else "--data-args-path"
        other = next((f for f, g in zip(PER_SPLIT_FLAGS, split_given) if g), "--per-split-data-args-path")
        raise DataError(f"{one} and {other} exclude each other: give one blend split by --split, or a dataset per "
                        "split (--train-data-path, --valid-data-path, --test-data-path)")
    if any(split_given) and per_split_args_path is not None:
        raise DataError("--per-split-data-args-path and --train/valid/test-data-path exclude each other: the file "
                        "holds all three")
    if data_args_path is not None:
        return _blend_from_file(data_args_path), None
    if not separate:
        return data_path, None
    per_split = _per_split_from_file(per_split_args_path) if per_split_args_path is not None else \
        [list(x) if x else None for x in (train, valid, test)]
    if per_split[0] is None:
        where = f"--per-split-data-args-path {per_split_args_path}" if per_split_args_path else "--valid/test-data-path"
        raise DataError(f"{where} without a train dataset: give --train-data-path (or \"train\" in the file)")
    for flag, blend in zip(PER_SPLIT_FLAGS, per_split):
        if blend is not None:
            try:
                parse_blend(blend)
            except DataError as e:
                raise DataError(str(e).replace("--data-path", flag, 1)) from None
    return None, per_split


def default_cache_dirs(prefixes) -> list[str]:
    """Where megatron-core caches a GPTDataset's indices without --data-cache-path, as upstream:
    `<prefix>/cache/GPTDataset_indices`, next to the data."""
    return [os.path.join(p, "cache", "GPTDataset_indices") for p in prefixes]

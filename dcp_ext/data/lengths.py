"""Real per-document token counts shipped with the repo (data/lengths/, provenance in its README).

Benchmarks, tests and the planning CLIs read them by file name, so results stay
comparable and name their source.
"""
from __future__ import annotations

import os

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data", "lengths")


def lengths_path(name: str) -> str:
    """Path of a shipped length file (`code_python_cl100k.txt`, ...), or `name` if it is a path."""
    if os.path.exists(name):
        return name
    path = os.path.join(DATA_DIR, name)
    if not os.path.exists(path):
        known = sorted(f for f in os.listdir(DATA_DIR) if f.endswith(".txt"))
        raise FileNotFoundError(f"no length file {name!r}; shipped: {', '.join(known)}")
    return path


def read_lengths(name: str, limit: int | None = None) -> list[int]:
    with open(lengths_path(name)) as f:
        values = [int(x) for x in f.read().split()]
    return values[:limit] if limit is not None else values

"""Input checks shared by every kernel: bad input raises ValueError naming the item.

Kernels (C++ and Python) assume validated input, so every public entry point goes
through here first: lengths become a list of positive ints, replicas a list of
parameter tuples with finite non-negative costs.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .model import ReplicaCost


def check_lengths(lengths, *, allow_empty: bool = True) -> np.ndarray:
    """Lengths as a 1-D int64 array; each must be a positive integer."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        if not allow_empty:
            raise ValueError("lengths is empty")
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        items = list(lengths)
        bad = next((i for i, x in enumerate(items)
                    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating))), 0)
        raise ValueError(f"sequence {bad} has length {items[bad]!r}, expected a positive integer")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"sequence {i} has length {arr[i].item()!r}, expected a positive integer")
        if np.any(np.abs(arr) >= 2.0**62):
            i = int(np.flatnonzero(np.abs(arr) >= 2.0**62)[0])
            raise ValueError(f"sequence {i} has length {arr[i].item()!r}, too large")
    elif arr.dtype == np.uint64 and np.any(arr >= 2**62):
        i = int(np.flatnonzero(arr >= 2**62)[0])
        raise ValueError(f"sequence {i} has length {arr[i].item()!r}, too large")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i} has non-positive length {int(arr[i])}")
    return arr


def _check_number(name: str, j: int, field: str, x, *, integer: bool, minimum: float) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} {j}: {field} = {x!r} is not a number")
    if integer:
        if isinstance(x, (float, np.floating)) and (not math.isfinite(x) or x != int(x)):
            raise ValueError(f"{name} {j}: {field} = {x!r} is not an integer")
    elif not math.isfinite(float(x)):
        raise ValueError(f"{name} {j}: {field} = {x!r} is not finite")
    if x < minimum:
        raise ValueError(f"{name} {j}: {field} = {x!r} must be >= {minimum}")


def check_replica(rc: ReplicaCost, j: int = 0, name: str = "replica") -> tuple:
    if not isinstance(rc, ReplicaCost):
        raise ValueError(f"{name} {j} is a {type(rc).__name__}, expected ReplicaCost")
    for field in ("a", "b", "c", "mb_overhead"):
        _check_number(name, j, field, getattr(rc, field), integer=False, minimum=0.0)
    for field in ("pp", "max_seq_len", "max_mb_tokens"):
        _check_number(name, j, field, getattr(rc, field), integer=True, minimum=1)
    return rc.as_tuple()


_VALID: dict = {}  # ReplicaCost -> its checked tuple (the planner passes the same few every iteration)


def check_replicas(replicas: Sequence[ReplicaCost]) -> list[tuple]:
    if replicas is None or len(replicas) == 0:
        raise ValueError("no replicas given")
    out = []
    for j, rc in enumerate(replicas):
        try:
            p = _VALID.get(rc) if type(rc) is ReplicaCost else None
        except TypeError:  # an unhashable field: validate (and fail) below
            p = None
        if p is None:
            p = check_replica(rc, j)
            if len(_VALID) > 4096:
                _VALID.clear()
            try:
                _VALID[rc] = p
            except TypeError:
                pass
        out.append(p)
    return out


def check_fits(lengths: np.ndarray, params: list[tuple]) -> None:
    """Every sequence must fit at least one replica (length <= min(max_seq_len, max_mb_tokens))."""
    if lengths.size == 0:
        return
    best = max(min(p[5], p[6]) for p in params)
    bad = np.flatnonzero(lengths > best)
    if bad.size:
        i = int(bad[0])
        if len(params) == 1:
            raise ValueError(f"sequence {i} (length {int(lengths[i])}) exceeds the replica's capacity "
                             f"(max_seq_len {params[0][5]}, max_mb_tokens {params[0][6]})")
        raise ValueError(f"sequence {i} (length {int(lengths[i])}) exceeds every replica's "
                         f"max_seq_len / max_mb_tokens (max {best})")


def check_count(name: str, x, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {x!r}")
    return int(x)

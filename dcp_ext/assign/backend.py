"""Which implementation runs the kernels: the C++ extension, else the Python reference.

`dcp_ext.kernels._kernels` (built from csrc/ by setup.py) is used when importable; otherwise
the pure-Python reference, with ONE warning. DCP_ASSIGN_IMPL=python forces the reference
(DCP_ASSIGN_IMPL=cpp demands the extension). Both expose the same five kernel functions
with the same arguments, so callers can also pick one per call (`impl="python"`).
"""
from __future__ import annotations

import os
import warnings

from dcp_ext.kernels import compiled as _CPP  # the one extension, loaded once (dcp_ext.kernels)

from . import ref_balance, ref_baselines, ref_pack, ref_plan


class PythonBackend:
    name = "python"

    @staticmethod
    def balance(lengths, params, seed, restarts, local_search, budget, starts):
        return ref_balance.balance(list(map(int, lengths)), params, seed, restarts, local_search, budget, starts)

    @staticmethod
    def pack(lengths, p, seed, restarts, budget):
        return ref_pack.pack(list(map(int, lengths)), p, seed, restarts, budget)

    @staticmethod
    def plan(lengths, params, seed, restarts, budget, starts, pack_restarts, pack_budget, calib_rounds):
        return ref_plan.plan(list(map(int, lengths)), params, seed, restarts, budget, starts, pack_restarts,
                             pack_budget, calib_rounds)

    @staticmethod
    def pack_assignment(lengths, params, assignment, seed, pack_restarts, pack_budget):
        return ref_plan.pack_assignment(list(map(int, lengths)), params, list(map(int, assignment)),
                                        seed, pack_restarts, pack_budget)

    @staticmethod
    def baseline(name, lengths, params, seed):
        return ref_baselines.run(name, list(map(int, lengths)), params, seed)


_PY = PythonBackend()
_warned = False


def default_backend():
    global _warned
    want = os.environ.get("DCP_ASSIGN_IMPL", "").strip().lower()
    if want == "python":
        return _PY
    if want == "cpp":
        if _CPP is None:
            raise ImportError("DCP_ASSIGN_IMPL=cpp but the extension dcp_ext.kernels._kernels is not built "
                              "(run: python setup.py build_ext --inplace)")
        return _CPP
    if want not in ("", "auto"):
        raise ValueError(f"DCP_ASSIGN_IMPL must be 'cpp', 'python' or unset, got {want!r}")
    if _CPP is not None:
        return _CPP
    if not _warned:
        _warned = True
        warnings.warn("dcp_ext.kernels._kernels is not built: dcp_ext.assign uses the pure-Python reference "
                      "(slow). Build it with: python setup.py build_ext --inplace", RuntimeWarning, stacklevel=3)
    return _PY


def get(impl: str | None):
    """The backend for `impl` in (None, 'cpp', 'python'); None means the default."""
    if impl is None:
        return default_backend()
    if impl == "python":
        return _PY
    if impl == "cpp":
        if _CPP is None:
            raise ImportError("the C++ extension dcp_ext.kernels._kernels is not built")
        return _CPP
    raise ValueError(f"impl must be 'cpp', 'python' or None, got {impl!r}")


def cpp_available() -> bool:
    return _CPP is not None

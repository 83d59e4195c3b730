"""The planner's C++ kernels, and the one place that loads them.

Why it exists: the adaptive planner's stage 1 and stage 2, the candidate pool's dynamic
program and the lower bound's search run every iteration, so they are C++ (csrc/planner.cpp,
csrc/bound.cpp, pybind11, built by setup.py as `dcp_ext.kernels._kernels`), each bit for bit
its Python reference. `kernel(name)` hands a caller the compiled function, or None where the
extension is not built or DCP_KERNELS=python asks for the references (the old name,
DCP_ASSIGN_IMPL, from when the kernels were dcp_ext.assign's, still works); the caller then runs
its reference. The side plan's stage 1 by search (csrc/stage1_search.cpp) is one of them;
csrc/module.cpp registers them all.
"""
from __future__ import annotations

import os

try:
    from dcp_ext.kernels import _kernels as compiled  # type: ignore[attr-defined]
except ImportError:  # not built: every caller runs its Python reference
    compiled = None


def built() -> bool:
    """Whether the C++ extension is importable."""
    return compiled is not None


def kernel(name: str):
    """One function of the C++ extension by name, or None where it is not built or
    DCP_KERNELS=python asks for the Python references."""
    if compiled is None or wants_references():
        return None
    return getattr(compiled, name, None)


def wants_references() -> bool:
    """DCP_KERNELS=python (or its old name DCP_ASSIGN_IMPL=python) is set."""
    return any(os.environ.get(name, "").strip().lower() == "python" for name in ("DCP_KERNELS", "DCP_ASSIGN_IMPL"))

"""Shared pieces of the dcp_ext.assign tests (imported by test_assign*.py; holds no test itself):
implementations to run, hypothesis strategies."""
from __future__ import annotations

import pytest
from hypothesis import strategies as st

from dcp_ext.assign import ReplicaCost, cpp_available

IMPLS = [
    pytest.param("python", id="python"),
    pytest.param("cpp", id="cpp", marks=pytest.mark.skipif(not cpp_available(), reason="C++ extension not built")),
]


@st.composite
def replica_costs(draw, max_len: int = 4096) -> ReplicaCost:
    msl = draw(st.sampled_from([max_len // 8, max_len // 2, max_len]))
    mmt = draw(st.sampled_from([msl, msl, 2 * msl, max(1, msl // 2)]))
    return ReplicaCost(
        a=draw(st.sampled_from([0.0, 1e-9, 3e-8])) * draw(st.floats(0.5, 2.0)),
        b=draw(st.sampled_from([0.0, 1e-5, 1e-4])) * draw(st.floats(0.5, 2.0)),
        c=draw(st.sampled_from([0.0, 1e-4, 1e-3])),
        mb_overhead=draw(st.sampled_from([0.0, 1e-3, 5e-3])),
        pp=draw(st.integers(1, 4)),
        max_seq_len=msl,
        max_mb_tokens=mmt,
    )


@st.composite
def instances(draw, max_n: int = 40, max_r: int = 5):
    """(lengths, replicas) where every sequence fits at least one replica."""
    reps = draw(st.lists(replica_costs(), min_size=1, max_size=max_r))
    if draw(st.booleans()):  # duplicates: replica types with several members
        reps = reps + reps[: draw(st.integers(0, len(reps)))]
    cap = max(r.seq_cap for r in reps)
    lengths = draw(st.lists(st.integers(1, cap), min_size=0, max_size=max_n))
    return lengths, reps

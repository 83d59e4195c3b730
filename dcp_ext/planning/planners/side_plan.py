"""The side plan: dcp_ext.assign's alternative stage 1 + 2, tried on the leading candidate.

Why a module of its own: it is the one door between the adaptive planner and the second
planner stack (`dcp_ext/assign`, its C++ in csrc/assign_*.cpp). Beside the main kernels
it plans the leading candidate again, and the plan that prices lower stays. Measured on the
pinned plans (tests/planning/test_plan_digests.py) it wins 5 of 40 cases by 0.009-0.047% of
predicted time; at h200x1024 with 18k documents it took 35 of 95 ms per iteration and never
won, hence the document budget (`side_plan_max_docs`).
"""
from __future__ import annotations

import math

from dcp_ext.planning.planners.batch_prep import BatchPrep
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica, finish_replica


def enabled(option: str) -> bool:
    """Whether to plan the side plan: "auto" where the C++ build of dcp_ext.assign is there,
    "on" always (ImportError without dcp_ext.assign), "off" never."""
    if option not in ("auto", "on", "off"):
        raise ValueError(f"side_plan must be auto, on or off, not {option!r}")
    if option == "off":
        return False
    try:
        import dcp_ext.assign as assign
    except ImportError:
        if option == "on":
            raise
        return False
    return option == "on" or assign.cpp_available()


def side_plan(cm, pool_tables: dict, placement, prep: BatchPrep, t_est: float, seed: int,
              beat: float = math.inf) -> list[PackedReplica] | None:
    """Stage 1 + 2 by dcp_ext.assign.plan_replicas for the replicas of `placement`, whose
    leading-candidate estimate is `t_est`. Its cost model has no per-replica
    constant and no recompute, so: each replica's costs are scaled by T/(T - sync) (equal
    scaled times then mean equal finish times with sync), and micro-batches are capped
    at the no-recompute token cap (a batch with a document longer than every cap is
    left to the Python stage 1). Nor does it know quadratic memory: there a replica takes
    documents up to the longest that fits without recompute, finish_replica raises the
    recompute its packed micro-batches need, and a plan memory cannot hold is no plan.
    `beat`: the time the plan must be faster than to be taken; once a replica's time
    reaches it, the rest is not priced (None: the caller keeps its plan either way)."""
    import dcp_ext.assign as A

    R = len(placement)
    rcs = []
    for lay, _ in placement:
        tt = pool_tables[lay]
        co = cm.coeffs(lay, 0)
        sync = prep.sync(lay, R)
        k = t_est / max(t_est - sync, 1e-9 * t_est)
        cap = int(tt.cap_mb)
        longest = min(cap, int(tt.doc_caps[0])) if tt.quadratic else cap
        if cap < 1 or longest < 1:
            return None
        rcs.append(A.ReplicaCost(co.a * k, co.b * k, co.c * k, co.c0 * k, lay.pp, longest, cap))
    if prep.n and int(prep.s.max()) > max(r.max_seq_len for r in rcs):
        return None
    res = A.plan_replicas(prep.s, rcs, seed=seed)
    out = []
    for k, (lay, ranks) in enumerate(placement):
        mbs = [([int(d) for d in mb], 0) for mb in res.micro_batches[k] if len(mb)]
        try:
            out.append(finish_replica(cm, pool_tables[lay], ranks, prep.s_list, mbs, R))
        except PlanningError:
            return None
        if not out[-1].time_s < beat:
            return None  # its slowest replica is already no faster: it cannot be taken
    return out

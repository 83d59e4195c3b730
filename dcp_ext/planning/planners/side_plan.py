"""The side plan: the leading candidate planned a second time, its stage 1 by search.

Why a module of its own: stage 1 (`stage1`) is quick enough for every candidate the planner
plans in full. On the one that leads, this spends more on where each document goes
(`stage1_search`: an iterated local search over the replicas' estimates), then packs and
prices the shares as every plan is (`packing.pack_and_price`); the plan that prices lower
stays. Measured on the pinned plans (tests/planning/test_plan_digests.py) it decides 5 of
39, by 0.008-0.21% of an iteration's predicted time; at h200x1024 with 18k documents it took
a third of the planning time and never won, hence the document budget
(`side_plan_max_docs`).
"""
from __future__ import annotations

import numpy as np

from dcp_ext.kernels import built
from dcp_ext.planning.planners.batch_prep import BatchPrep
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica, pack_and_price
from dcp_ext.planning.planners.stage1_search import ReplicaCost, search


def enabled(option: str) -> bool:
    """Whether to plan the side plan: "auto" where the C++ kernels are built (the Python
    reference is slow for every iteration; with DCP_KERNELS=python it runs, so that the
    plans stay those of the kernels), "on" always, "off" never."""
    if option not in ("auto", "on", "off"):
        raise ValueError(f"side_plan must be auto, on or off, not {option!r}")
    if option == "auto":
        return built()
    return option == "on"


def side_plan(cm, pool_tables: dict, placement, prep: BatchPrep, t_est: float, seed: int) -> list[PackedReplica] | None:
    """The replicas of `placement` (the leading candidate, whose estimate is `t_est`) with
    their documents handed out by `stage1_search`, packed and priced (the caller keeps
    the faster plan); None when it cannot be made. The search's model has no per-replica
    constant and no recompute, so each replica's costs are scaled by T/(T - sync) (equal
    scaled times then mean equal finish times with sync), and its micro-batches are
    capped at the no-recompute token cap: a batch with a document longer than every cap is
    left to stage 1. Where memory is quadratic in length, a replica takes documents up to
    the longest that fits without recompute; packing then raises the recompute its
    micro-batches need, and a plan memory cannot hold is no plan."""
    replicas = []
    for lay, _ in placement:
        tt = pool_tables[lay]
        co = cm.coeffs(lay, 0)
        sync = prep.sync(lay, len(placement))
        k = t_est / max(t_est - sync, 1e-9 * t_est)
        cap = int(tt.cap_mb)
        longest = min(cap, int(tt.doc_caps[0])) if tt.quadratic else cap
        if cap < 1 or longest < 1:
            return None
        replicas.append(ReplicaCost(co.a * k, co.b * k, co.c * k, co.c0 * k, lay.pp, longest, cap))
    if prep.n and int(prep.s.max()) > max(r.longest for r in replicas):
        return None
    where = search(prep.s, replicas, seed)
    position = np.empty(prep.n, dtype=np.int64)
    position[prep.order] = np.arange(prep.n)
    docs: list[list[int]] = [[] for _ in placement]
    for i, r in enumerate(where):
        docs[r].append(int(position[i]))
    try:
        return pack_and_price(cm, pool_tables, prep, placement, [sorted(d) for d in docs])
    except PlanningError:
        return None

"""Stage 1 + stage 2 in pure Python: the reference of the C++ `plan` kernel.

Balance assigns replicas; each replica's sequences (in index order) are then packed with
seed derive_seed(seed, r); replica times are replica_time of the packed micro-batches.

Calibration: the stage-1 estimate is a lower bound, and packing loses most against it on
pipeline replicas with few sequences. When some replica's packed time exceeds its
estimate by more than CALIB_MIN, stage 1 runs again with each replica's cost
coefficients (a, b, c, mb_overhead; the estimate scales with them) multiplied by
f_r = max over rounds of packed / estimated time, the result is packed, and the plan with
the smaller makespan is kept (ties: the first). Estimates returned are always those of
the unscaled replicas.
"""
from __future__ import annotations

from . import ref_balance, ref_pack
from .model import estimate, replica_time_params, seq_cost
from .rng import derive_seed

CALIB_MIN = 1e-3  # recalibrate when a replica's packed time exceeds its estimate by this


def pack_assignment(lengths, params, assignment, seed, pack_restarts, pack_budget):
    """-> (micro_batches per replica with global indices, replica times)."""
    R = len(params)
    members: list[list[int]] = [[] for _ in range(R)]
    for i, r in enumerate(assignment):
        members[r].append(i)
    mbs_all, times = [], []
    for r in range(R):
        sub = [lengths[i] for i in members[r]]
        local = ref_pack.pack(sub, params[r], derive_seed(seed, r), pack_restarts, pack_budget)
        mbs = [[members[r][j] for j in mb] for mb in local]
        mbs_all.append(mbs)
        times.append(replica_time_params(params[r], lengths, mbs))
    return mbs_all, times


def estimates(lengths, params, assignment) -> list[float]:
    """Stage-1 estimate of each replica for an assignment (sums by length descending)."""
    R = len(params)
    members: list[list[int]] = [[] for _ in range(R)]
    for i in ref_balance.sorted_order(lengths):
        members[assignment[i]].append(lengths[i])
    out = []
    for p, lens in zip(params, members):
        W = 0.0
        for s in lens:
            W += seq_cost(p, s)
        out.append(estimate(p, W, sum(lens), seq_cost(p, lens[0]) if lens else 0.0, len(lens)))
    return out


def plan(lengths, params, seed, restarts, budget, starts, pack_restarts, pack_budget, calib_rounds=1):
    """-> (assignment, micro_batches, replica times, stage-1 estimates)."""
    assignment, est, _, _ = ref_balance.balance(lengths, params, seed, restarts, True, budget, starts)
    mbs, times = pack_assignment(lengths, params, assignment, seed, pack_restarts, pack_budget)
    best = (assignment, mbs, times, est)
    f = [1.0] * len(params)
    for _ in range(calib_rounds):
        loss = [t / e if e > 0.0 else 1.0 for t, e in zip(times, est)]
        if not max(loss) > 1.0 + CALIB_MIN:
            break
        f = [x if x > y else y for x, y in zip(f, loss)]
        scaled = [(p[0] * k, p[1] * k, p[2] * k, p[3] * k, p[4], p[5], p[6]) for p, k in zip(params, f)]
        assignment, _, _, _ = ref_balance.balance(lengths, scaled, seed, restarts, True, budget, starts)
        mbs, times = pack_assignment(lengths, params, assignment, seed, pack_restarts, pack_budget)
        est = estimates(lengths, params, assignment)
        if max(times) < max(best[2]):
            best = (assignment, mbs, times, est)
    return best

"""Stage 1 + stage 2 in pure Python: the reference of the C++ `plan` kernel.

Balance assigns replicas; each replica's sequences (in index order) are then packed with
seed derive_seed(seed, r); replica times are replica_time of the packed micro-batches.
"""
from __future__ import annotations

from . import ref_balance, ref_pack
from .model import replica_time_params
from .rng import derive_seed


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


def plan(lengths, params, seed, restarts, budget, pack_restarts, pack_budget):
    """-> (assignment, micro_batches, replica times, stage-1 estimates)."""
    assignment, est, _, _ = ref_balance.balance(lengths, params, seed, restarts, True, budget)
    mbs, times = pack_assignment(lengths, params, assignment, seed, pack_restarts, pack_budget)
    return assignment, mbs, times, est

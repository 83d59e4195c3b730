"""Stage 1 of the adaptive planner: which replica runs each document of the batch.

Why a module of its own: it is one job with two implementations that must agree bit for
bit, the C++ kernel (`stage1` in csrc/planner.cpp) and its Python reference here, which runs
where the kernels are not built or DCP_KERNELS=python asks for it. Stage 1a hands the
documents out longest first, each to the replica that finishes it earliest among the types
whose length range (from the water-filling estimate, `batch_prep.screen`) holds it or more
capable ones; stage 1b (`rebalance`) then moves and swaps documents between replicas. What
a replica's share costs once packed is stage 2's business (`packing`).
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from dcp_ext.kernels import kernel
from dcp_ext.planning.layout import Layout, LayoutMix, describe
from dcp_ext.planning.planners.batch_prep import BatchPrep
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.rebalance import rebalance


def assign_documents(prep: BatchPrep, counts: LayoutMix, placement, sync: list[float], order, j_of_pos,
                     move_targets: int, max_moves: int | None) -> list[list[int]]:
    """The sorted positions of the batch each replica of `placement` (the mix `counts`,
    placed) runs. `sync`: each replica's sync time; `order`, `j_of_pos`: the estimate's
    types from most to least capable and, per sorted position, the last type whose range
    holds it; `move_targets`, `max_moves`: stage 1b's budget (None: its default)."""
    stage1 = kernel("stage1")
    if stage1 is not None and prep.n:
        return by_kernel(stage1, prep, counts, placement, sync, order, j_of_pos, move_targets, max_moves)
    return reference(prep, counts, placement, sync, order, j_of_pos, move_targets, max_moves)


def by_kernel(stage1, prep: BatchPrep, counts: LayoutMix, placement, sync: list[float], order, j_of_pos,
               move_targets: int, max_moves: int | None) -> list[list[int]]:
    """`reference` by the C++ kernel (csrc/planner.cpp), equal to it."""
    types = list(dict.fromkeys(lay for lay, _ in placement))
    tob = [prep.types[lay] for lay in types]
    index = {lay: t for t, lay in enumerate(types)}
    costs = np.stack([t.cost for t in tob])
    in_order = np.array([index[lay] for lay, _, _ in order], dtype=np.int64)
    held = np.isfinite(costs[in_order]).any(axis=0)
    if not held.all():
        p = int(np.argmin(held))
        raise PlanningError(f"a sequence of {int(prep.ss[p])} tokens fits no replica of {describe(counts)}")
    return stage1(costs, np.array([lay.pp for lay in types], dtype=np.int64), np.array([t.c0 for t in tob], dtype=float),
                  np.array([t.tt.mb_full for t in tob], dtype=float),
                  np.array([index[lay] for lay, _ in placement], dtype=np.int64), np.asarray(sync, dtype=float),
                  in_order, np.asarray(j_of_pos, dtype=np.int64), int(move_targets),
                  -1 if max_moves is None else int(max_moves))

def reference(prep: BatchPrep, counts: LayoutMix, placement, sync: list[float], order, j_of_pos,
               move_targets: int, max_moves: int | None) -> list[list[int]]:
    """The Python reference of the kernel `by_kernel` runs."""
    R = len(placement)
    by_type: dict[Layout, list[int]] = {}
    for k, (lay, _) in enumerate(placement):
        by_type.setdefault(lay, []).append(k)
    docs: list[list[int]] = [[] for _ in range(R)]  # sorted positions per replica
    work = [0.0] * R
    tob = [prep.types[lay] for lay, _ in placement]

    # stage 1a: earliest finish, longest first. A document may go to the type whose
    # length range (from the estimate) holds it or to a type ranked before it (more
    # capable); shorter documents then fill whatever is left anywhere.
    heaps = []
    for lay, _, _ in order:
        h = [(sync[k], k) for k in by_type[lay]]
        heapq.heapify(h)
        heaps.append(h)
    is_pp = [lay.pp > 1 for lay, _, _ in order]
    costs = [prep.types[lay].cost for lay, _, _ in order]
    big = [0.0] * R
    nt = len(order)
    inf = math.inf
    for p in range(prep.n):
        jmax = j_of_pos[p]
        if jmax >= nt:
            jmax = nt - 1
        best_k, best_t, best_j = -1, inf, -1
        for j in range(jmax + 1):
            c = costs[j][p]
            if c == inf:
                continue
            load, k = heaps[j][0]
            if is_pp[j]:
                t = tob[k].finish(sync[k], work[k] + c, big[k] if big[k] > c else c)
            else:
                t = load + c  # the heap holds k's finish: sync + work, summed document by document
            if t < best_t:
                best_k, best_t, best_j = k, t, j
        if best_k < 0:  # nothing up to its range holds it: any type that can
            for j in range(nt):
                c = costs[j][p]
                if c != inf:
                    load, k = heaps[j][0]
                    t = tob[k].finish(sync[k], work[k] + c, max(big[k], c))
                    if t < best_t:
                        best_k, best_t, best_j = k, t, j
        if best_k < 0:
            raise PlanningError(f"a sequence of {int(prep.ss[p])} tokens fits no replica of {describe(counts)}")
        c = costs[best_j][p]
        docs[best_k].append(p)
        work[best_k] += c
        if is_pp[best_j] and c > big[best_k]:
            big[best_k] = c
        heapq.heapreplace(heaps[best_j], (best_t, best_k))
    # stage 1b: move documents from the most to the least loaded replica
    rebalance(docs, work, tob, sync, move_targets, max_moves)
    return docs

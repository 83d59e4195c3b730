"""Stage 1b of the adaptive planner: single moves and pairwise swaps between replicas.

Why a module of its own: stage 1a (`batch_plan.full_plan`) hands out documents in
one greedy pass; this local search then evens out the replicas' estimated finish times
(`TypeOnBatch.finish`) before stage 2 packs them. It only moves documents between
replicas; what a replica costs is the estimate's business, how it runs is stage 2's.

Every replica k is described by parallel lists: `docs[k]` (sorted positions of the batch),
`work[k]` (the sum of their costs on k's type), `tob[k]` (k's type on this batch) and
`sync[k]` (its sync time). They are changed in place.
"""
from __future__ import annotations

import numpy as np

from dcp_ext.planning.planners.batch_prep import TypeOnBatch


def largest_cost(t: TypeOnBatch, ds) -> float:
    """The bubble term of a pipeline replica: its largest document's cost (0 for pp == 1)."""
    if t.tt.pp == 1 or not ds:
        return 0.0
    return max(t.cost[p] for p in ds)


def rebalance(docs: list[list[int]], work: list[float], tob: list[TypeOnBatch], sync: list[float],
              move_targets: int, max_moves: int | None) -> None:
    """Move single documents off the replica with the latest estimated finish onto one of
    the `move_targets` earliest ones, while that lowers the later of the two; then swaps."""
    R = len(docs)
    if R < 2:
        return
    big = [largest_cost(tob[k], docs[k]) for k in range(R)]
    times = [tob[k].finish(sync[k], work[k], big[k]) for k in range(R)]
    by_layout: dict = {}
    for k in range(R):
        by_layout.setdefault(tob[k].tt.layout, []).append(k)
    limit = max_moves if max_moves is not None else 4 * R + 16
    swaps = 0
    for _ in range(limit):
        hi = max(range(R), key=lambda k: (times[k], -k))
        t_hi = times[hi]
        if not docs[hi]:
            break
        th = tob[hi]
        dh = np.asarray(docs[hi])
        ch = th.cost[dh]
        if th.tt.pp > 1:
            order = np.sort(ch)[::-1]
            top0 = order[0]
            top1 = order[1] if len(order) > 1 else 0.0
            big_after = np.where(ch >= top0, top1, top0)
        else:
            big_after = 0.0
        a = th.finish(sync[hi], work[hi] - ch, big_after)
        best = None  # (new max of the pair, doc index in hi, target)
        for lo in sorted(range(R), key=lambda k: times[k])[:move_targets]:
            if lo == hi or t_hi - times[lo] <= 1e-9 * t_hi:
                continue
            tl = tob[lo]
            cn = tl.cost[dh]
            bl = np.maximum(big[lo], cn) if tl.tt.pp > 1 else 0.0
            with np.errstate(invalid="ignore"):
                m = np.maximum(a, tl.finish(sync[lo], work[lo] + cn, bl))
            m = np.where(np.isfinite(cn), m, np.inf)
            j = int(np.argmin(m))
            if m[j] < t_hi - 1e-12 and (best is None or m[j] < best[0]):
                best = (float(m[j]), j, lo)
        if best is None:
            # a swap only when the spread is worth it
            if t_hi - min(times) <= 2e-3 * t_hi or swaps >= R:
                break
            swaps += 1
            if not _swap(hi, docs, work, tob, sync, times, big, by_layout, move_targets):
                break
            continue
        _, j, lo = best
        p = docs[hi].pop(j)
        work[hi] -= th.cost[p]
        docs[lo].append(p)
        work[lo] += tob[lo].cost[p]
        for k in (hi, lo):
            big[k] = largest_cost(tob[k], docs[k])
            times[k] = tob[k].finish(sync[k], work[k], big[k])


def _swap(hi, docs, work, tob, sync, times, big, by_layout, move_targets: int) -> bool:
    """Exchange one document of the latest replica with a cheaper one of an earlier
    replica (of the same layout, or one of the `move_targets` earliest overall) if that
    lowers the later of the two. Returns whether a swap was made."""
    t_hi = times[hi]
    same = sorted(by_layout[tob[hi].tt.layout], key=lambda k: times[k])[:move_targets]
    overall = sorted(range(len(docs)), key=lambda k: times[k])[:move_targets]
    best = None
    c_hi = tob[hi].cost

    def finish(k, w, bg):
        # the sync as recovered from k's current time (times - work - overhead), not
        # sync[k]: the two differ in the last bits, and the plans follow these bits
        t = tob[k]
        base = times[k] - work[k]
        if t.tt.pp > 1:
            base = base - t.overhead(work[k], big[k])
        return t.finish(base, w, bg)

    for lo in dict.fromkeys(same + overall):
        if lo == hi or times[lo] >= t_hi:
            continue
        dh, dl = np.asarray(docs[hi]), np.asarray(docs[lo])
        if not len(dh) or not len(dl):
            continue
        c_lo = tob[lo].cost
        hp, lp = c_hi[dh], c_lo[dh]  # hi's documents on hi / on lo
        hq, lq = c_hi[dl], c_lo[dl]  # lo's documents on hi / on lo
        w_hi = work[hi] - hp[:, None] + hq[None, :]
        w_lo = work[lo] - lq[None, :] + lp[:, None]
        # pipelines: keep the old largest document as the bubble (conservative)
        b_hi = np.maximum(big[hi], hq[None, :]) if tob[hi].tt.pp > 1 else 0.0
        b_lo = np.maximum(big[lo], lp[:, None]) if tob[lo].tt.pp > 1 else 0.0
        with np.errstate(invalid="ignore"):
            m = np.maximum(finish(hi, w_hi, b_hi), finish(lo, w_lo, b_lo))
            m = np.where(np.isfinite(m) & (hq[None, :] < hp[:, None]), m, np.inf)
        flat = int(np.argmin(m))
        i, j = divmod(flat, m.shape[1])
        if m[i, j] < t_hi - 1e-9 and (best is None or m[i, j] < best[0]):
            best = (float(m[i, j]), i, lo, j)
    if best is None:
        return False
    _, i, lo, j = best
    p, q = docs[hi][i], docs[lo][j]
    docs[hi][i], docs[lo][j] = q, p
    work[hi] += tob[hi].cost[q] - tob[hi].cost[p]
    work[lo] += tob[lo].cost[p] - tob[lo].cost[q]
    for k in (hi, lo):
        big[k] = largest_cost(tob[k], docs[k])
        times[k] = tob[k].finish(sync[k], work[k], big[k])
    return True

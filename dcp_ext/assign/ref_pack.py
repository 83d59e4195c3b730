"""Stage 2 (pack) in pure Python: the reference the C++ kernel must equal bit for bit.

One replica's sequences go into micro-batches of at most max_mb_tokens tokens so that
    time = sum_k (o + C_k) + q * (o + max_k C_k)        (C_k: sum of sequence costs in k)
is smallest (o = mb_overhead, q = pp - 1). With pp == 1 only the count matters: classic
best-fit decreasing (tightest open bin, ties: lower bin; a new bin when none fits).
Otherwise, for a count v of micro-batches the time is at
least LB(v) = W + v*o + q*(o + max(W/v, m)), convex in v, so v is enumerated outwards from
its integer minimiser v* (first up, then down) while LB(v) can still beat the best found
by more than 1e-4 of it.

  pack_v   v bins; sequences by decreasing length go to the bin with the smallest cost
           among those with room (LPT under the token cap; ties: lower bin); if one does
           not fit anywhere, best-fit decreasing by tokens (tightest room; ties: lower
           bin); if that fails too, v is infeasible.
  improve  local search on the largest bin:
           best move of one sequence to a bin with room, else best swap, accepted when it
           lowers that bin's cost by a relative 1e-12; binary searches as in stage 1. It
           stops when what is left to gain, (pp-1) * (largest - max(W/v, m)), is below
           1e-4 of LB(v).
  restarts attempt k >= 1 re-packs the best v with lengths * (1 + 0.3 u) ordering.
Micro-batches come out in bin order (empty ones dropped), indices ascending inside.
"""
from __future__ import annotations

import math
from bisect import bisect_left, insort

from .model import seq_cost
from .ref_balance import REL_TOL, crossing, first_at_most, perturbed_order, sorted_order
from .rng import SplitMix64

GOOD_ENOUGH = 1e-4  # stop improving once (pp-1) * (largest - its lower bound) < this * LB(v)


class Bins:
    def __init__(self, v: int) -> None:
        self.C = [0.0] * v
        self.T = [0] * v
        self.mem: list[list[tuple[int, int]]] = [[] for _ in range(v)]


def pack_v(lengths, costs, cap: int, v: int, order):
    b = Bins(v)
    ok = True
    for i in order:
        s = lengths[i]
        k_best = -1
        for k in range(v):
            if b.T[k] + s <= cap and (k_best < 0 or b.C[k] < b.C[k_best]):
                k_best = k
        if k_best < 0:
            ok = False
            break
        b.C[k_best] += costs[i]
        b.T[k_best] += s
        b.mem[k_best].append((-s, i))
    if not ok:  # best-fit decreasing by tokens
        b = Bins(v)
        for i in order:
            s = lengths[i]
            k_best = -1
            for k in range(v):
                if b.T[k] + s <= cap and (k_best < 0 or b.T[k] > b.T[k_best]):
                    k_best = k
            if k_best < 0:
                return None
            b.C[k_best] += costs[i]
            b.T[k_best] += s
            b.mem[k_best].append((-s, i))
    for m in b.mem:
        m.sort()
    return b


def best_fit_decreasing(lengths, order, cap: int) -> list[list[int]]:
    """Classic BFD: each sequence into the open bin with the least room that fits (ties:
    lower bin), a new bin when none does."""
    room: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        s = lengths[i]
        k_best = -1
        for k in range(len(room)):
            if room[k] >= s and (k_best < 0 or room[k] < room[k_best]):
                k_best = k
        if k_best < 0:
            room.append(cap - s)
            bins.append([i])
        else:
            room[k_best] -= s
            bins[k_best].append(i)
    return bins


def bins_time(b: Bins, o: float, q: int) -> float:
    t, cm = 0.0, 0.0
    for k in range(len(b.C)):
        if b.mem[k]:
            t += o + b.C[k]
            if b.C[k] > cm:
                cm = b.C[k]
    return t + q * (o + cm)


def improve(b: Bins, costs, cap: int, budget: int, good_enough: float) -> None:
    v = len(b.C)
    evals = 0
    while evals < budget:
        k = max(range(v), key=lambda x: (b.C[x], -x))
        M = b.C[k]
        if not M > good_enough:
            return
        best_val, best = M - M * REL_TOL, None
        memk = b.mem[k]
        nk = len(memk)
        # moves
        for j in range(v):
            if j == k:
                continue
            lo = first_at_most(memk, cap - b.T[j])
            if lo >= nk:
                continue

            def A(p):
                nonlocal evals
                evals += 1
                return b.C[k] - costs[memk[p][1]]

            def B(p):
                nonlocal evals
                evals += 1
                return b.C[j] + costs[memk[p][1]]

            ps = crossing(A, B, lo, nk)
            for p in (ps - 1, ps):
                if lo <= p < nk:
                    x, y = A(p), B(p)
                    val = x if x > y else y
                    if val < best_val:
                        best_val, best = val, (j, p, -1, x, y)
        if best is None:  # swaps
            for j in range(v):
                if j == k:
                    continue
                memj = b.mem[j]
                stop = False
                for q in range(len(memj)):
                    lj = -memj[q][0]
                    if q > 0 and lj == -memj[q - 1][0]:
                        continue
                    if evals >= budget:
                        stop = True
                        break
                    lo = first_at_most(memk, cap - b.T[j] + lj)
                    hi = first_at_most(memk, lj)
                    if lo >= hi:
                        continue
                    cj = costs[memj[q][1]]

                    def A(p):
                        nonlocal evals
                        evals += 1
                        return b.C[k] - costs[memk[p][1]] + cj

                    def B(p):
                        nonlocal evals
                        evals += 1
                        return b.C[j] - cj + costs[memk[p][1]]

                    ps = crossing(A, B, lo, hi)
                    for p in (ps - 1, ps):
                        if lo <= p < hi:
                            x, y = A(p), B(p)
                            val = x if x > y else y
                            if val < best_val:
                                best_val, best = val, (j, p, q, x, y)
                if stop:
                    break
        if best is None:
            return
        j, p, q, x, y = best
        neg_a, a = memk[p]
        del memk[p]
        b.T[k] += neg_a
        b.T[j] -= neg_a
        if q >= 0:
            neg_b, bi = b.mem[j][q]
            del b.mem[j][q]
            insort(memk, (neg_b, bi))
            b.T[k] -= neg_b
            b.T[j] += neg_b
        insort(b.mem[j], (neg_a, a))
        b.C[k], b.C[j] = x, y


def _lb(W: float, m: float, o: float, q: int, v: int) -> float:
    return W + v * o + q * (o + max(W / v, m))


def _good_enough(W: float, m: float, o: float, q: int, v: int) -> float:
    """Largest micro-batch cost at which improving stops: within GOOD_ENOUGH of LB(v)."""
    return max(W / v, m) + GOOD_ENOUGH * _lb(W, m, o, q, v) / q


def _vstar(W: float, m: float, o: float, q: int, v0: int, n: int) -> int:
    if q == 0:
        return v0
    vk = W / m if m > 0.0 else 0.0
    vc = min(math.sqrt(q * W / o), vk) if o > 0.0 else vk
    f = math.floor(vc) if vc < n else n
    best_v, best = v0, math.inf
    for v in (f, f + 1):
        v = min(max(v, v0), n)
        val = _lb(W, m, o, q, v)
        if val < best:
            best_v, best = v, val
    return best_v


def pack(lengths: list[int], p: tuple, seed: int, restarts: int, budget: int) -> list[list[int]]:
    n = len(lengths)
    if n == 0:
        return []
    o, q, cap = p[3], p[4] - 1, p[6]
    costs = [seq_cost(p, s) for s in lengths]
    order = sorted_order(lengths)
    W, T = 0.0, 0
    for i in order:
        W += costs[i]
        T += lengths[i]
    if q == 0:  # time = W + v*o: only the count matters
        return [sorted(b) for b in best_fit_decreasing(lengths, order, cap)]
    m = costs[order[0]]
    v0 = (T + cap - 1) // cap
    vs = _vstar(W, m, o, q, v0, n)

    best_t, best_b, best_v = math.inf, None, vs

    def attempt(v, ordr):
        b = pack_v(lengths, costs, cap, v, ordr)
        if b is None:
            return None
        improve(b, costs, cap, budget, _good_enough(W, m, o, q, v))
        return b

    def consider(v):
        nonlocal best_t, best_b, best_v
        if best_b is not None and not _lb(W, m, o, q, v) < best_t - best_t * GOOD_ENOUGH:
            return False
        b = attempt(v, order)
        if b is not None:
            t = bins_time(b, o, q)
            if t < best_t:
                best_t, best_b, best_v = t, b, v
        return True

    v = vs
    while v <= n and consider(v):
        v += 1
    v = vs - 1
    while v >= v0 and consider(v):
        v -= 1
    if restarts > 0:
        rng = SplitMix64(seed)
        for _ in range(restarts):
            b = attempt(best_v, perturbed_order(lengths, rng))
            if b is not None:
                t = bins_time(b, o, q)
                if t < best_t:
                    best_t, best_b = t, b
    return [sorted(i for _, i in mem) for mem in best_b.mem if mem]

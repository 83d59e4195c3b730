"""Stage 1 (balance) in pure Python: the reference the C++ kernel must equal bit for bit.

Scheduling on unrelated machines with eligibility: each sequence goes to one replica so
that the largest stage-1 estimate (model.estimate) is smallest.

  starts   the greedy runs once per start, each followed by the local search; start k >= 1
           lets pipeline replicas (pp > 1) take only sequences up to the START_QUANTILES[k]
           length quantile (unless no pp == 1 replica holds them): a pipeline replica pays
           (pp-1) x its largest micro-batch, and largest-first greedy hands it long
           sequences the search cannot trade back one at a time. Best start wins.
  greedy   sequences by decreasing length (ties: lower index). Replicas with identical
           parameters form a type; within a type the candidate is the replica with the
           smallest estimate (ties: lower index), across types the one whose estimate
           after adding the sequence is smallest (ties: lower replica index).
  improve  local search on the critical replica c (largest estimate, ties: lower index):
           the best move of one of its sequences to another replica, else the best swap,
           accepted when max(new est of c, new est of the other) < est of c by a relative
           1e-12. Both sides of that max are monotone in the moved length, so each
           (target replica[, swapped-in length]) is a binary search over c's sequences
           sorted by (length desc, index asc). When neither exists, an ejection chain:
           the first move c -> r (r ascending, lengths descending) that lowers c below
           the threshold and after which the best move or swap off r to a third replica
           brings r below it too. Every estimate evaluated counts against `budget`, which
           bounds the work deterministically.
  restarts iterated local search: restart k copies the best solution so far, makes
           2 + k % 3 random moves (SplitMix64(seed): a sequence index, then another
           replica; skipped if it cannot hold the sequence), runs the local search and
           replaces the best when its makespan is not larger (plateaus are walked).
Costs are recomputed from scratch for the final estimates, so float drift of the
incremental sums never reaches the result.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort

from .model import estimate, seq_cost
from .rng import SplitMix64

PERTURB = 0.3  # pack restarts order by length * (1 + PERTURB * u)
REL_TOL = 1e-12
KICK_MIN, KICK_SPREAD = 2, 3  # restart k kicks with KICK_MIN + k % KICK_SPREAD random moves
# Greedy start k caps the sequences pipeline replicas take at this length quantile (1.0: no cap).
START_QUANTILES = (1.0, 0.95, 0.85, 0.75, 0.65, 0.5, 0.35)


def replica_types(params: list[tuple]) -> list[tuple[tuple, list[int]]]:
    """Replicas with identical parameters, grouped in order of first appearance."""
    index: dict[tuple, int] = {}
    out: list[tuple[tuple, list[int]]] = []
    for r, p in enumerate(params):
        if p not in index:
            index[p] = len(out)
            out.append((p, []))
        out[index[p]][1].append(r)
    return out


def sorted_order(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def perturbed_order(lengths: list[int], rng: SplitMix64) -> list[int]:
    keys = [lengths[i] * (1.0 + PERTURB * rng.next_double()) for i in range(len(lengths))]
    return sorted(range(len(lengths)), key=lambda i: (-keys[i], i))


class State:
    """Per-replica aggregates; members sorted by (length desc, index asc) as (-len, idx)."""

    def __init__(self, params: list[tuple]) -> None:
        R = len(params)
        self.params = params
        self.W = [0.0] * R
        self.T = [0] * R
        self.mx = [0.0] * R
        self.est = [0.0] * R
        self.mem: list[list[tuple[int, int]]] = [[] for _ in range(R)]


def greedy(lengths: list[int], params: list[tuple], types, order: list[int], theta: int = 0) -> State:
    """theta > 0: pipeline replicas (pp > 1) refuse sequences longer than theta unless no
    replica with pp == 1 can hold them."""
    st = State(params)
    heaps = [[(0.0, r) for r in reps] for _, reps in types]
    caps = [min(p[5], p[6]) for p, _ in types]
    flat_cap = max([caps[t] for t, (p, _) in enumerate(types) if p[4] == 1], default=0)
    for i in order:
        s = lengths[i]
        best_val, best_r, best_t, best_c, best_m = math.inf, -1, -1, 0.0, 0.0
        for t, (p, _) in enumerate(types):
            if s > caps[t]:
                continue
            if theta > 0 and p[4] > 1 and s > theta and s <= flat_cap:
                continue
            r = heaps[t][0][1]
            c = seq_cost(p, s)
            m2 = c if c > st.mx[r] else st.mx[r]
            val = estimate(p, st.W[r] + c, st.T[r] + s, m2, len(st.mem[r]) + 1)
            if val < best_val or (val == best_val and r < best_r):
                best_val, best_r, best_t, best_c, best_m = val, r, t, c, m2
        r = best_r
        st.W[r] += best_c
        st.T[r] += s
        st.mx[r] = best_m
        st.est[r] = best_val
        st.mem[r].append((-s, i))
        heapq.heapreplace(heaps[best_t], (best_val, r))
    for m in st.mem:
        m.sort()
    return st


def recompute(st: State) -> None:
    """Exact aggregates from the member lists (sums in member order)."""
    for r, p in enumerate(st.params):
        W, T = 0.0, 0
        for neg, _ in st.mem[r]:
            W += seq_cost(p, -neg)
            T += -neg
        st.W[r], st.T[r] = W, T
        st.mx[r] = seq_cost(p, -st.mem[r][0][0]) if st.mem[r] else 0.0
        st.est[r] = estimate(p, W, T, st.mx[r], len(st.mem[r]))


def first_at_most(mem: list[tuple[int, int]], x: int) -> int:
    """First position whose length is <= x (members sorted by length desc)."""
    return bisect_left(mem, (-x, -1))


def crossing(A, B, lo: int, hi: int) -> int:
    """Smallest p in [lo, hi) with A(p) >= B(p) (A non-decreasing, B non-increasing), else hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if A(mid) >= B(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Search:
    """One local-search run; `evals` counts estimate evaluations against `budget`."""

    def __init__(self, st: State, budget: int) -> None:
        self.st = st
        self.budget = budget
        self.evals = 0
        self.caps = [min(p[5], p[6]) for p in st.params]

    def est(self, p, W, T, m, n) -> float:
        self.evals += 1
        return estimate(p, W, T, m, n)

    def max_after_removal(self, r: int, pos: int) -> float:
        mem = self.st.mem[r]
        if pos != 0:
            return self.st.mx[r]
        return seq_cost(self.st.params[r], -mem[1][0]) if len(mem) > 1 else 0.0

    def run(self) -> None:
        st = self.st
        R = len(st.params)
        while self.evals < self.budget:
            c = max(range(R), key=lambda r: (st.est[r], -r))
            Mk = st.est[c]
            if not Mk > 0.0:
                return
            thr = Mk - Mk * REL_TOL
            best = self.best_move(c, thr, -1)
            if best is None:
                best = self.best_swap(c, thr, -1)
            if best is not None:
                self.apply(c, best)
            elif not self.chain(c, thr):
                return

    def chain(self, c: int, thr: float) -> bool:
        """Depth-2 ejection: move a sequence off c to r (overloading r), then the best
        move or swap off r to a third replica; applied when both end below thr."""
        st = self.st
        pc, memc = st.params[c], st.mem[c]
        nc = len(memc)
        for r in range(len(st.params)):
            if r == c:
                continue
            pr = st.params[r]
            lo = first_at_most(memc, self.caps[r])
            for p in range(lo, nc):
                l = -memc[p][0]
                if p > lo and l == -memc[p - 1][0]:
                    continue
                if self.evals >= self.budget:
                    return False
                a = self.est(pc, st.W[c] - seq_cost(pc, l), st.T[c] - l, self.max_after_removal(c, p), nc - 1)
                if not a < thr:
                    break
                cr = seq_cost(pr, l)
                m2 = cr if cr > st.mx[r] else st.mx[r]
                b = self.est(pr, st.W[r] + cr, st.T[r] + l, m2, len(st.mem[r]) + 1)
                saved = (st.W[c], st.T[c], st.mx[c], st.est[c], st.W[r], st.T[r], st.mx[r], st.est[r])
                item = memc[p]
                self.apply(c, ("move", r, p, -1, a, b))
                if b < thr:
                    return True
                second = self.best_move(r, thr, c)
                if second is None:
                    second = self.best_swap(r, thr, c)
                if second is not None:
                    self.apply(r, second)
                    return True
                del st.mem[r][bisect_left(st.mem[r], item)]
                memc.insert(p, item)
                (st.W[c], st.T[c], st.mx[c], st.est[c], st.W[r], st.T[r], st.mx[r], st.est[r]) = saved
        return False

    def best_move(self, c: int, thr: float, skip: int):
        st = self.st
        pc, memc = st.params[c], st.mem[c]
        nc = len(memc)
        best_val, best = thr, None
        for r in range(len(st.params)):
            if r == c or r == skip:
                continue
            pr = st.params[r]
            lo = first_at_most(memc, self.caps[r])
            if lo >= nc:
                continue
            nr = len(st.mem[r])

            def A(p):
                l = -memc[p][0]
                return self.est(pc, st.W[c] - seq_cost(pc, l), st.T[c] - l, self.max_after_removal(c, p), nc - 1)

            def B(p):
                l = -memc[p][0]
                cr = seq_cost(pr, l)
                m2 = cr if cr > st.mx[r] else st.mx[r]
                return self.est(pr, st.W[r] + cr, st.T[r] + l, m2, nr + 1)

            ps = crossing(A, B, lo, nc)
            for p in (ps - 1, ps):
                if lo <= p < nc:
                    a, b = A(p), B(p)
                    val = a if a > b else b
                    if val < best_val:
                        best_val, best = val, ("move", r, p, -1, a, b)
        return best

    def best_swap(self, c: int, thr: float, skip: int):
        st = self.st
        pc, memc = st.params[c], st.mem[c]
        nc = len(memc)
        best_val, best = thr, None
        for r in range(len(st.params)):
            if r == c or r == skip:
                continue
            pr, memr = st.params[r], st.mem[r]
            nr = len(memr)
            lo = first_at_most(memc, self.caps[r])
            for q in range(nr):
                lj = -memr[q][0]
                if q > 0 and lj == -memr[q - 1][0]:
                    continue
                if self.evals >= self.budget:
                    return best
                if lj > self.caps[c]:
                    continue
                hi = first_at_most(memc, lj)  # c's sequences longer than lj
                if lo >= hi:
                    continue
                cj_c = seq_cost(pc, lj)
                cj_r = seq_cost(pr, lj)
                mr_after = self.max_after_removal(r, q)

                def A(p):
                    li = -memc[p][0]
                    m_after = self.max_after_removal(c, p)
                    m_new = cj_c if cj_c > m_after else m_after
                    return self.est(pc, st.W[c] - seq_cost(pc, li) + cj_c, st.T[c] - li + lj, m_new, nc)

                def B(p):
                    li = -memc[p][0]
                    ci_r = seq_cost(pr, li)
                    m_new = ci_r if ci_r > mr_after else mr_after
                    return self.est(pr, st.W[r] - cj_r + ci_r, st.T[r] - lj + li, m_new, nr)

                ps = crossing(A, B, lo, hi)
                for p in (ps - 1, ps):
                    if lo <= p < hi:
                        a, b = A(p), B(p)
                        val = a if a > b else b
                        if val < best_val:
                            best_val, best = val, ("swap", r, p, q, a, b)
        return best

    def apply(self, c: int, best) -> None:
        st = self.st
        kind, r, p, q, a, b = best
        pc, pr = st.params[c], st.params[r]
        neg_i, i = st.mem[c][p]
        li = -neg_i
        if kind == "move":
            st.W[c] = st.W[c] - seq_cost(pc, li)
            st.T[c] -= li
            st.W[r] = st.W[r] + seq_cost(pr, li)
            st.T[r] += li
            del st.mem[c][p]
            insort(st.mem[r], (neg_i, i))
        else:
            neg_j, j = st.mem[r][q]
            lj = -neg_j
            st.W[c] = st.W[c] - seq_cost(pc, li) + seq_cost(pc, lj)
            st.T[c] += lj - li
            st.W[r] = st.W[r] - seq_cost(pr, lj) + seq_cost(pr, li)
            st.T[r] += li - lj
            del st.mem[c][p]
            del st.mem[r][q]
            insort(st.mem[c], (neg_j, j))
            insort(st.mem[r], (neg_i, i))
        for x in (c, r):
            st.mx[x] = seq_cost(st.params[x], -st.mem[x][0][0]) if st.mem[x] else 0.0
        st.est[c], st.est[r] = a, b


def clone(st: State) -> State:
    out = State(st.params)
    out.W, out.T, out.mx, out.est = list(st.W), list(st.T), list(st.mx), list(st.est)
    out.mem = [list(m) for m in st.mem]
    return out


def kick(st: State, lengths: list[int], rng: SplitMix64, moves: int) -> None:
    """`moves` random moves (a random sequence to a random other replica that can hold it)."""
    R, n = len(st.params), len(lengths)
    where = [0] * n
    for r, mem in enumerate(st.mem):
        for _, i in mem:
            where[i] = r
    for _ in range(moves):
        i = rng.next_below(n)
        r = where[i]
        t = rng.next_below(R - 1)
        if t >= r:
            t += 1
        if lengths[i] > min(st.params[t][5], st.params[t][6]):
            continue
        del st.mem[r][bisect_left(st.mem[r], (-lengths[i], i))]
        insort(st.mem[t], (-lengths[i], i))
        where[i] = t
    recompute(st)


def start_thresholds(lengths: list[int], params: list[tuple], starts: int) -> list[int]:
    """Length caps for pipeline replicas, one per greedy start (0: none), duplicates dropped."""
    out = [0]
    if not lengths or not any(p[4] > 1 for p in params) or not any(p[4] == 1 for p in params):
        return out
    asc = sorted(lengths)
    n = len(asc)
    for f in START_QUANTILES[1:starts]:
        theta = asc[min(n - 1, int(f * n))]
        if theta < asc[-1] and theta not in out:
            out.append(theta)
    return out


def balance(lengths: list[int], params: list[tuple], seed: int, restarts: int,
            local_search: bool, budget: int, starts: int = 1):
    """-> (assignment list, estimates list, makespan, greedy makespan of the first start)."""
    n = len(lengths)
    types = replica_types(params)
    order = sorted_order(lengths)
    best, best_ms, greedy_ms = None, 0.0, 0.0
    for theta in start_thresholds(lengths, params, starts):
        st = greedy(lengths, params, types, order, theta)
        recompute(st)
        if best is None:
            greedy_ms = max(st.est)
        if local_search:
            _Search(st, budget).run()
            recompute(st)
        if best is None or max(st.est) < best_ms:
            best, best_ms = st, max(st.est)
    rng = SplitMix64(seed)
    if len(params) > 1 and n > 0:
        for k in range(restarts):
            cur = clone(best)
            kick(cur, lengths, rng, KICK_MIN + k % KICK_SPREAD)
            if local_search:
                _Search(cur, budget).run()
                recompute(cur)
            ms = max(cur.est)
            if ms <= best_ms:
                best, best_ms = cur, ms
    assignment = [0] * n
    for r, mem in enumerate(best.mem):
        for _, i in mem:
            assignment[i] = r
    return assignment, list(best.est), best_ms, greedy_ms

"""Stage 1 by search: the leading candidate's documents handed out again by an iterated local
search, the Python reference of the C++ kernel `stage1_search` (csrc/stage1_search.cpp).

Why a module of its own: stage 1 (`stage1`) is one greedy pass and a short move-and-swap
polish, fast enough for every candidate. On the leading candidate the side plan
(`side_plan`) spends more: this search. It wins where a few documents must be split very
evenly over equal replicas (0.008-0.21% of an iteration's predicted time on 5 of the pinned
plans). The kernel and this reference return the same assignment, bit for bit; every float
expression keeps the operation order of the C++.

The model, per replica, in seconds per pipeline stage (`ReplicaCost`):
    a document of s tokens costs a*s*s + b*s + c; a micro-batch adds o;
    the estimate of a replica is a lower bound of its time over every packing of its
    documents (W: their summed cost, T: their tokens, m: the largest cost, n: their count,
    q = pp - 1, v0 = ceil(T / cap)):  W + q*o + min over v0 <= v <= n of v*o + q*max(W/v, m),
    W + o*v0 for q == 0. The bracket is convex in v, so the floor and ceiling of its real
    minimiser min(sqrt(q*W/o), W/m), clamped to [v0, n], are all that is tried.

The search, minimising the largest estimate:
    greedy   documents longest first (ties: lower index); within a group of equal replicas
             the one with the smallest estimate, across groups the one whose estimate after
             taking the document is smallest (ties: lower replica index);
    improve  on the replica with the largest estimate (ties: lower index): the best move of
             one of its documents to another replica, else the best swap, taken when the
             larger of the two new estimates is below the old by a relative 1e-12. Both sides
             are monotone in the moved length, so each target is a binary search over the
             documents sorted by (length desc, index asc). When neither exists, a depth-2
             ejection: the first move off it that brings it below and after which a move or
             swap off the receiving replica to a third brings that one below too. Every
             estimate counts against `budget`;
    restarts restart k copies the best assignment, makes 2 + k % 3 random moves
             (SplitMix64(seed): a document, then another replica; skipped when that cannot
             hold it), improves, and keeps the result when its largest estimate is not larger.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from typing import NamedTuple, Sequence

import numpy as np

from dcp_ext.kernels import kernel

REL_TOL = 1e-12  # a step must gain this fraction of the largest estimate
KICK_MIN, KICK_SPREAD = 2, 3  # restart k makes KICK_MIN + k % KICK_SPREAD random moves
MASK64 = (1 << 64) - 1


class ReplicaCost(NamedTuple):
    """One replica as the search prices it (module docstring); field order as the kernel reads it."""

    a: float  # per document, times its length squared
    b: float  # per token
    c: float  # per document
    o: float  # per micro-batch
    pp: int
    longest: int  # the longest document it holds
    cap: int  # tokens of one micro-batch


def restarts_for(n: int) -> int:
    """Restarts for a batch of n documents: many for small batches, none for large ones."""
    return 16 if n <= 100 else 4 if n <= 1000 else 0


def budget_for(n: int) -> int:
    """Estimates one local search may evaluate (a deterministic bound on its work)."""
    return 10_000 + n


def search(lengths: np.ndarray, replicas: Sequence[ReplicaCost], seed: int) -> list[int]:
    """The replica of each document (`lengths`, in batch order): the kernel where built,
    else `reference`; both with `restarts_for` and `budget_for` the batch's size."""
    n = len(lengths)
    run = kernel("stage1_search")
    params = [tuple(r) for r in replicas]
    seed = int(seed) & MASK64
    if run is not None:
        return run(np.asarray(lengths, dtype=np.int64), params, seed, restarts_for(n), budget_for(n))
    return reference([int(x) for x in lengths], params, seed, restarts_for(n), budget_for(n))


# ---- the arithmetic (the operation order of csrc/stage1_search.cpp)

def seq_cost(p: tuple, s: int) -> float:
    x = float(s)
    return p[0] * x * x + p[1] * x + p[2]


def estimate(p: tuple, W: float, T: int, m: float, n: int) -> float:
    """The lower bound of the module docstring; 0 for an empty replica."""
    if n == 0:
        return 0.0
    o = p[3]
    q = p[4] - 1
    cap = p[6]
    v0 = (T + cap - 1) // cap
    if q == 0:
        return W + o * v0
    vk = W / m if m > 0.0 else 0.0
    vc = min(math.sqrt(q * W / o), vk) if o > 0.0 else vk
    f = math.floor(vc) if vc < n else n
    best = math.inf
    for v in (f, f + 1):
        v = min(max(v, v0), n)
        val = v * o + q * max(W / v, m)
        if val < best:
            best = val
    return W + q * o + best


class SplitMix64:
    """The random generator the kernel also writes, so that seeded runs agree."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_below(self, n: int) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return (z ^ (z >> 31)) % n


# ---- the search

def cap_of(p: tuple) -> int:
    return min(p[5], p[6])


class State:
    """Per replica: summed cost W, tokens T, largest cost mx, estimate est, and its members
    as (-length, index), sorted."""

    def __init__(self, params: list[tuple]) -> None:
        R = len(params)
        self.params = params
        self.W = [0.0] * R
        self.T = [0] * R
        self.mx = [0.0] * R
        self.est = [0.0] * R
        self.mem: list[list[tuple[int, int]]] = [[] for _ in range(R)]

    def copy(self) -> "State":
        out = State(self.params)
        out.W, out.T, out.mx, out.est = list(self.W), list(self.T), list(self.mx), list(self.est)
        out.mem = [list(m) for m in self.mem]
        return out

    def recompute(self) -> None:
        """Exact aggregates from the members (sums in member order), so no drift of the
        incremental sums reaches the result."""
        for r, p in enumerate(self.params):
            W, T = 0.0, 0
            for neg, _ in self.mem[r]:
                W += seq_cost(p, -neg)
                T += -neg
            self.W[r], self.T[r] = W, T
            self.mx[r] = seq_cost(p, -self.mem[r][0][0]) if self.mem[r] else 0.0
            self.est[r] = estimate(p, W, T, self.mx[r], len(self.mem[r]))


def greedy(lengths: list[int], params: list[tuple]) -> State:
    st = State(params)
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(p, []).append(r)
    types = list(groups.items())
    heaps = [[(0.0, r) for r in reps] for _, reps in types]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        s = lengths[i]
        best_val, best_r, best_t, best_c, best_m = math.inf, -1, -1, 0.0, 0.0
        for t, (p, _) in enumerate(types):
            if s > cap_of(p):
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


def first_at_most(mem: list[tuple[int, int]], x: int) -> int:
    """The first member no longer than x."""
    return bisect_left(mem, (-x, -1))


def crossing(A, B, lo: int, hi: int) -> int:
    """The smallest p in [lo, hi) with A(p) >= B(p) (A non-decreasing, B non-increasing), else hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if A(mid) >= B(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class Improve:
    """One local search ("improve" in the module docstring) on a state, within its budget."""

    def __init__(self, st: State, budget: int) -> None:
        self.st = st
        self.budget = budget
        self.evals = 0
        self.caps = [cap_of(p) for p in st.params]

    def est(self, p, W, T, m, n) -> float:
        self.evals += 1
        return estimate(p, W, T, m, n)

    @staticmethod
    def around_crossing(A, B, lo: int, hi: int, best_val: float, best, step):
        """The two positions on either side of where c's side A crosses r's side B in
        [lo, hi): `step(p, a, b)` at the one whose larger side is below best_val (and the
        lower of the two). Returns (best_val, best)."""
        ps = crossing(A, B, lo, hi)
        for p in (ps - 1, ps):
            if lo <= p < hi:
                a, b = A(p), B(p)
                val = a if a > b else b
                if val < best_val:
                    best_val, best = val, step(p, a, b)
        return best_val, best

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

            best_val, best = self.around_crossing(A, B, lo, nc, best_val, best,
                                                  lambda p, a, b, r=r: ("move", r, p, -1, a, b))
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
                hi = first_at_most(memc, lj)  # c's documents longer than lj
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

                best_val, best = self.around_crossing(A, B, lo, hi, best_val, best,
                                                      lambda p, a, b, r=r, q=q: ("swap", r, p, q, a, b))
        return best

    def apply(self, c: int, step) -> None:
        st = self.st
        kind, r, p, q, a, b = step
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


def kick(st: State, lengths: list[int], rng: SplitMix64, moves: int) -> None:
    """`moves` random moves: a random document to a random other replica that can hold it."""
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
        if lengths[i] > cap_of(st.params[t]):
            continue
        del st.mem[r][bisect_left(st.mem[r], (-lengths[i], i))]
        insort(st.mem[t], (-lengths[i], i))
        where[i] = t
    st.recompute()


def reference(lengths: list[int], params: list[tuple], seed: int, restarts: int, budget: int) -> list[int]:
    """The search of the module docstring: the replica of each document. Every document
    must fit some replica (`longest`, `cap`); the caller checks."""
    n = len(lengths)
    best = greedy(lengths, params)
    best.recompute()
    Improve(best, budget).run()
    best.recompute()
    best_ms = max(best.est)
    rng = SplitMix64(seed)
    if len(params) > 1 and n > 0:
        for k in range(restarts):
            cur = best.copy()
            kick(cur, lengths, rng, KICK_MIN + k % KICK_SPREAD)
            Improve(cur, budget).run()
            cur.recompute()
            ms = max(cur.est)
            if ms <= best_ms:
                best, best_ms = cur, ms
    assignment = [0] * n
    for r, mem in enumerate(best.mem):
        for _, i in mem:
            assignment[i] = r
    return assignment

"""A lower bound on the iteration time that no plan of a batch can beat on a cluster.

Why it exists: the planners are judged by their gap to this number, so it must be a true
bound (a relaxation of every plan the simulator accepts: any layouts, assignment, packing,
order and recompute) and as tight as can be proven. The simulator (`dcp_ext.planning.simulator`)
defines the truth: T = max over replicas of sync + 1F1B makespan of its micro-batches.

Relaxation. Documents are split fractionally over devices; a document d placed on layout L
needs `size_L * x_d / cap_L(T, d)` devices, where x_d is the least work it adds to a
replica's stage (additive part of the cost, at any recompute level that holds it) and
cap_L the most such work one replica can do in T (less its receive-side sync, its
micro-batch constants and its pipeline bubble). T is feasible if the needs of all
documents (each on its cheapest layout) fit the world, and no document alone is slower
than T on the layout it uses. `refine` also fixes the longest document's replica.

Pipeline bubble (pp > 1), proven on the simulator's exact 1F1B (identical stages, stage j
runs min(pp-1-j, m) warm-up forwards, then F/B pairs, then the remaining backwards). The
makespan M is the longest path of the dependency graph; the path "stage 0 up to F(i),
F(i) up the stages, the last stage from F(i) to B(k), B(k) down the stages, stage 0 to
the end" gives, for every i <= k (micro-batches in schedule order, f/b their stage times,
W = sum of f + b):

    M >= W + (pp-1) * (f_i + b_k) - sum_{i-pp < l < i} b_l - sum_{k < l < k+pp} f_l.

With i = 0:
  (1) k = m-1:            M >= W + (pp-1) * (f_0 + b_last)          >= W + (pp-1)*c0
  (2) averaged over k:    M >= W + (pp-1) * (f_0 + (sum b - sum f) / m)
      (each f_l is subtracted for at most pp-1 values of k); sum b - sum f is additive
      over documents: >= m*(c0_b - c0_f) + gamma * X, X the documents' additive work;
  (3) k = the last micro-batch of largest b: every later one has b_l <= b_k, and the
      cost model gives f_l <= (b_l + kappa) / rho (rho, kappa from the coefficients), so
      M >= W + (pp-1) * (f_0 + (1 - 1/rho) * b_k - kappa/rho), and b_k is at least the
      backward of the replica's longest document.
A replica running m micro-batches (W >= X + m*c0) therefore satisfies
    X + m*c0 + (pp-1) * max(c0, c0_f + dc + gamma*X/m, psi(longest document)) <= T - sync
for some m >= 1 (or, using memory instead: 1F1B keeps pp consecutive micro-batches in
flight, so m >= pp*S/free - (pp-1) for S the kept activation bytes). The largest X that
allows is cap(T, psi), decreasing in psi; a replica's documents all have psi <= that of
its longest, so sum over its documents of x_d / cap(T, psi_d) <= 1: the per-document needs
are a valid relaxation. Which of the two ways (micro-batch count free, or bounded by
memory) a layout uses is fixed per layout before the search, so feasibility stays
monotone in T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dcp_ext.kernels import kernel
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout

_EPS = 1e-9  # relative slack on capacities (valid direction: a larger capacity)


@dataclass
class BoundTables:
    """Per (document, layout) numbers the bound needs, for one batch, and per layout the
    constants of its pipeline relaxation (see the module docstring)."""

    x0: np.ndarray  # [n, k] additive stage work (least over recompute levels that hold it); inf if none
    x1: np.ndarray  # [n, k] x0 plus the memory-forced share of micro-batch constants
    psi: np.ndarray  # [n, k] per-stage bubble floor (3) if the document is its replica's longest
    alone: np.ndarray  # [n, k] the document alone on one replica (pp stages + sync)
    sync: np.ndarray  # [k] receive-side sync per device
    layouts: list[Layout]
    size: np.ndarray = None  # [k] devices per replica
    q: np.ndarray = None  # [k] pp - 1
    c0: np.ndarray = None  # [k] least micro-batch constant (f + b) over recompute levels
    c0fb: np.ndarray = None  # [k] least forward constant + least backward constant: floor (1)
    cv: np.ndarray = None  # [k] constant of floor (2) (-inf: unusable)
    gamma: np.ndarray = None  # [k] sum b - sum f >= gamma * documents' additive work


def _layout_constants(cm: CostModel, lay: Layout):
    """(c0, c0fb, cv, gamma, rho, kappa) of a layout over every recompute level."""
    Ls = cm.layers_per_stage(lay)
    cos = [cm.coeffs(lay, rs) for rs in range(Ls + 1)]
    c0 = min(co.c0 for co in cos)
    c0f = min(co.c0_f for co in cos)
    c0b = min(co.c0_b for co in cos)
    dc = min(co.c0_b - co.c0_f for co in cos)
    gamma = math.inf
    rho = math.inf
    for co in cos:
        ex = co.cp_comm > 0.0
        att = co.cp_layers * co.cp_att if ex else 0.0
        # (sum b - sum f) per document: CP exchange costs at most att/4 more forward than backward
        d = (co.a_b - co.a_f - 0.25 * att, co.b_b - co.b_f, co.c_b - co.c_f)
        tot = (co.a, co.b, co.c)
        for dv, tv in zip(d, tot):
            if tv > 0:
                gamma = min(gamma, dv / tv)
            elif dv < 0:
                gamma = -math.inf
        # rho * f - b <= kappa for every micro-batch: each coefficient of rho*f below b's
        # (the exchange adds at most att/2 to rho*f - b when rho <= 2)
        conds = [(co.a_f, co.a_b - 0.5 * att), (co.b_f, co.b_b), (co.c_f, co.c_b)]
        for fv, bv in conds:
            if fv > 0:
                rho = min(rho, bv / fv)
            elif bv < 0:
                rho = -math.inf
        if ex:
            rho = min(rho, 2.0)  # the exchange bound above needs rho <= 2
        if min(co.a_b, co.b_b, co.c_b) < 0:
            rho = -math.inf  # a backward that can shrink with more tokens: no floor from (3)
    if not math.isfinite(gamma):
        gamma = 0.0 if gamma > 0 else -1.0
    gamma = min(gamma, 1.0)
    kappa = max(0.0, max(rho * co.c0_f - co.c0_b for co in cos)) if math.isfinite(rho) else math.inf
    cv = c0f + dc if gamma >= 0 else -math.inf
    return c0, c0f + c0b, cv, max(gamma, 0.0), rho, kappa, c0f, c0b


@dataclass
class _LayoutTerms:
    """What `bound_tables` needs of one layout that does not depend on the batch."""

    consts: tuple  # _layout_constants
    sync: float
    free: float  # device bytes beside the layout's state
    caps: np.ndarray = None  # [levels] most tokens alone per recompute level, made monotone
    # [8, levels]: per recompute level rs, the coefficients a, b, c, keep (c0 * pp * kept
    # activation bytes per token / free), a_b, b_b, c_b, c0
    levels: np.ndarray = None
    cp: np.ndarray = None  # [4, levels]: cp_att, cp_comm, cp_layers, cp_recompute


def _layout_terms(cm: CostModel, lay: Layout) -> _LayoutTerms:
    consts = _layout_constants(cm, lay)
    t = _LayoutTerms(consts, cm.sync_time(lay, None), cm.capacity_bytes - cm.state_bytes(lay))
    if t.free <= 0:
        return t
    Ls = cm.layers_per_stage(lay)
    t.caps = np.maximum.accumulate(np.array([cm.max_tokens(lay, rs, 1) for rs in range(Ls + 1)]))
    cos = [cm.coeffs(lay, rs) for rs in range(Ls + 1)]
    keep = [consts[0] * lay.pp * cm.act_bytes_per_token(lay, rs)[0] / t.free for rs in range(Ls + 1)]
    t.levels = np.array([[co.a for co in cos], [co.b for co in cos], [co.c for co in cos], keep,
                         [co.a_b for co in cos], [co.b_b for co in cos], [co.c_b for co in cos],
                         [co.c0 for co in cos]], dtype=float)
    t.cp = np.array([[co.cp_att, co.cp_comm, co.cp_layers, co.cp_recompute] for co in cos], dtype=float).T.copy()
    return t


def _layout_tables_numpy(s: np.ndarray, rs_min: np.ndarray, levels: np.ndarray, cp: np.ndarray, pp: int):
    """(x0, x1, b_min, a_min) of one layout, every recompute level at once (rows), a level
    only for the documents it holds (r >= rs_min); the kernel `bound_layout_tables` does the
    same in one pass."""
    from dcp_ext.planning.cost_model import ATTN_BWD_FACTOR

    lo = int(rs_min.min())
    sel = np.arange(lo, levels.shape[1])[:, None] >= rs_min[None, :]
    a, b, c, keep, a_b, b_b, c_b, c0 = (row[lo:, None] for row in levels)
    cost = a * s * s + b * s + c
    x0 = np.where(sel, cost, np.inf).min(axis=0)
    x1 = np.where(sel, cost + keep * s, np.inf).min(axis=0)
    b_min = np.where(sel, a_b * s * s + b_b * s + c_b, np.inf).min(axis=0)
    s2 = s * s
    excess = 0.0  # StageCoeffs.excess, 0 on levels without a kv exchange
    att_c, comm_c, layers, recomp = (row[lo:, None] for row in cp)
    if np.any(comm_c != 0.0):
        att, com = att_c * s2, comm_c * s
        ex_f = np.maximum(0.0, com - att)
        ex_b = np.maximum(0.0, 2.0 * com - ATTN_BWD_FACTOR * att)
        excess = np.where(comm_c == 0.0, 0.0, (layers + recomp) * ex_f + layers * ex_b)
    mb = c0 + a * s2 + b * s + c * 1 + excess
    return x0, x1, b_min, np.where(sel, pp * mb, np.inf).min(axis=0)


def _tables_kernel():
    from dcp_ext.planning.cost_model import ATTN_BWD_FACTOR

    f = kernel("bound_layout_tables")
    return (lambda s, rs_min, levels, cp, pp: f(s, rs_min, levels, cp, pp, ATTN_BWD_FACTOR)) if f else None


def _blank_tables(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None, by_layout: bool = False):
    """(layouts, lengths as floats, x0, x1, psi, alone, sync, per) before any layout is
    priced: the four tables [n, k] ([k, n] `by_layout`), per holds size, q, c0, c0fb, cv,
    gamma as rows."""
    layouts = [Layout(*l) for l in (layouts if layouts is not None else cm.all_layouts())]
    s = np.asarray(lengths, dtype=float)
    shape = (len(layouts), len(s)) if by_layout else (len(s), len(layouts))
    inf = np.full(shape, np.inf)
    return layouts, s, inf, inf.copy(), np.full(shape, -np.inf), inf.copy(), np.empty(len(layouts)), np.zeros((6, len(layouts)))


def bound_tables(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None = None,
                 cache: dict | None = None, impl: str = "auto") -> BoundTables:
    """Per document and layout: its least additive stage work (with and without the
    memory-forced share of micro-batch constants), its bubble floor as its replica's
    longest document, and its time alone. `cache` (a dict the caller keeps while `cm`'s
    prices do not change) holds the per-layout terms across batches. impl: "auto" (the C++
    kernel where built) or "python" (numpy), equal bit for bit. Every row depends on the
    document's length alone: each distinct length is priced once, a layout per row."""
    s_all = np.asarray(lengths, dtype=float)
    s, inv = np.unique(s_all, return_inverse=True)
    layouts, s, x0, x1, psi, alone, sync, per = _blank_tables(cm, s, layouts, by_layout=True)
    n = len(s)
    one_layout = (_tables_kernel() if impl == "auto" else None) or _layout_tables_numpy
    for j, lay in enumerate(layouts):
        t = cache.get(lay) if cache is not None else None
        if t is None:
            t = _layout_terms(cm, lay)
            if cache is not None:
                cache[lay] = t
        c0, c0fb, cv, gamma, rho, kappa, c0f, c0b = t.consts
        sync[j] = t.sync
        per[:, j] = (lay.size, lay.pp - 1, c0, c0fb, cv, gamma)
        if t.free <= 0 or n == 0:
            continue
        # the smallest recompute level that holds each document alone, and every larger one
        rs_min = np.searchsorted(t.caps, s, side="left")  # first rs with cap >= s
        if int(rs_min.min()) >= len(t.caps):
            continue
        x0[j], x1[j], b_min, a_min = one_layout(s, rs_min, t.levels, t.cp, lay.pp)
        alone[j] = a_min + sync[j]
        if lay.pp > 1 and rho >= 1.0 and math.isfinite(kappa):
            # (3): f_0 + (1 - 1/rho) * b_k - kappa/rho, b_k >= c0_b + the document's backward
            ok = np.isfinite(b_min)
            psi[j, ok] = c0f + (1.0 - 1.0 / rho) * (c0b + b_min[ok]) - kappa / rho
    x0, x1, psi, alone = (np.ascontiguousarray(a.T)[inv] for a in (x0, x1, psi, alone))  # [n, k], each document's row
    return BoundTables(x0, x1, psi, alone, sync, layouts, *per)


# ---------------------------------------------------------------------------- capacities
def capacity(room, psi, q, c0, c0fb, cv, gamma, theta):
    """Most additive work one replica can do in `room` seconds when its longest document
    has bubble floor psi: in x1 units (theta 1: micro-batch count from memory) or x0
    units (theta 0: any count m >= 1, floor (2) charged). Elementwise over broadcast
    arrays; <= 0 means none. Exact maxima (rounded up), so needs are never overstated."""
    room, psi, q, c0, c0fb, cv, gamma, theta = np.broadcast_arrays(
        *[np.asarray(v, dtype=float) for v in (room, psi, q, c0, c0fb, cv, gamma, theta)])
    u = np.maximum(c0fb, psi)  # floors (1) and (3)
    # theta 1: m*c0 counted from memory in x1, together with (pp-1)*c0 of the fill/drain
    cap1 = room - q * (u - c0)
    # theta 0: X + m*c0 + q*max(u, cv + gamma*X/m) <= room for some m >= 1, i.e.
    # X <= max_m min(f1(m), f2(m)), f1 = room - m*c0 - q*u (decreasing),
    # f2 = (Rp - m*c0) * m / (m + kg) (unimodal): the maximum is at m = 1, at f2's peak m_s
    # or where f1 and f2 cross (unique below m_s)
    simple = room - c0 - q * u
    use_v = np.isfinite(cv) & (gamma > 0) & (q > 0) & (c0 > 0)
    cvv = np.where(np.isfinite(cv), cv, 0.0)
    kg = q * gamma
    Rp = room - q * cvv
    c0s = np.where(c0 > 0, c0, 1.0)
    m_s = np.maximum(1.0, -kg + np.sqrt(kg * kg + np.maximum(Rp, 0.0) * kg / c0s))
    den = q * u + c0 * kg - q * cvv
    with np.errstate(divide="ignore", invalid="ignore"):
        m_c = np.where(den > 0, kg * (room - q * u) / np.where(den > 0, den, 1.0), 1.0)
    m_c = np.clip(np.nan_to_num(m_c, nan=1.0, posinf=1.0, neginf=1.0), 1.0, m_s)

    def g(m):
        with np.errstate(divide="ignore", invalid="ignore"):
            f2 = np.where(kg + m > 0, (Rp - m * c0) * m / (m + kg), -np.inf)
        return np.minimum(room - m * c0 - q * u, f2)

    best = np.maximum(np.maximum(g(1.0), g(m_s)), g(m_c))
    cap0 = np.where(use_v, best, simple)
    # no micro-batch constant at all (a degenerate profile): m unbounded
    free_m = np.where(np.isfinite(cv) & (gamma > 0), np.minimum(room - q * u, Rp), room - q * u)
    cap0 = np.where(c0 > 0, cap0, free_m)
    out = np.where(theta >= 1, cap1, cap0)
    return out + _EPS * np.abs(out)


class _Needs:
    """Devices each document needs on each layout at iteration time T, for one choice of
    theta per layout (the heavy parts precomputed)."""

    def __init__(self, tb: BoundTables, theta: np.ndarray):
        self.tb = tb
        self.theta = theta
        self.x = np.where(theta[None, :] >= 1, tb.x1, tb.x0)
        self.fin = np.isfinite(self.x)
        self.u = np.maximum(tb.c0fb[None, :], tb.psi)
        self.cols0 = np.nonzero((theta < 1) & (tb.q > 0))[0]

    def matrix(self, T: float) -> np.ndarray:
        """[n, k] needs (inf: cannot)."""
        tb = self.tb
        room = T - tb.sync
        # theta 1 columns (and pp == 1): closed form, cheap
        cap = room[None, :] - tb.q[None, :] * (self.u - tb.c0[None, :])
        pp1_0 = (self.theta < 1) & (tb.q == 0)
        if pp1_0.any():
            cap[:, pp1_0] -= tb.c0[pp1_0][None, :]
        if len(self.cols0):
            c = self.cols0
            cap[:, c] = capacity(room[c][None, :], tb.psi[:, c], tb.q[c], tb.c0[c], tb.c0fb[c], tb.cv[c], tb.gamma[c], 0.0)
        else:
            cap = cap + _EPS * np.abs(cap)
        ok = self.fin & (tb.alone <= T) & (cap > 0) & (room[None, :] > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(ok, tb.size[None, :] * self.x / np.where(ok, cap, 1.0), np.inf)

    def best(self, T: float) -> np.ndarray:
        """[n] each document's least need over layouts."""
        return self.matrix(T).min(axis=1)


def _bisect(feasible, lo: float, hi: float | None = None, rel: float = 1e-6) -> float:
    """Largest T known infeasible below the smallest feasible one (feasible monotone),
    to relative precision `rel`: every T below the result is infeasible."""
    if feasible(lo):
        return lo
    hi = max(lo, 1e-9) * 2 if hi is None else hi
    while not feasible(hi):
        lo, hi = hi, hi * 2
        if hi > 1e9:  # pragma: no cover
            raise RuntimeError("lower bound diverged")
    for _ in range(80):
        if hi - lo <= rel * hi:
            break
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _contiguous(*arrays) -> list[np.ndarray]:
    """float64, C order: what the kernels read."""
    return [np.ascontiguousarray(a, dtype=float) for a in arrays]


def _solve(tb: BoundTables, n_dev: int, lengths, theta: np.ndarray, refine: bool, impl: str = "auto") -> float:
    """The least time T at which the relaxation holds (see the module docstring), by
    bisection; `impl` "auto" runs the C++ kernel where built, "python" the reference below
    (the two are equal bit for bit: tests/planning/test_bound_kernel.py)."""
    solve = kernel("bound_solve") if impl == "auto" else None
    if solve is not None and len(lengths) > 0:
        return float(solve(*_contiguous(tb.x0, tb.x1, tb.psi, tb.alone, tb.sync, tb.size, tb.q, tb.c0, tb.c0fb, tb.cv,
                                        tb.gamma, theta), int(n_dev), np.asarray(lengths, dtype=np.int64), bool(refine)))
    return _solve_py(tb, n_dev, lengths, theta, refine)


def _solve_py(tb: BoundTables, n_dev: int, lengths, theta: np.ndarray, refine: bool) -> float:
    lo = float(tb.alone.min(axis=1).max())
    need_at = _Needs(tb, theta).best

    t0 = _bisect(lambda T: float(need_at(T).sum()) <= n_dev, lo)
    n = len(lengths)
    if not refine or n < 2:
        return t0
    kk = int(np.argmax(np.asarray(lengths)))
    others = np.arange(n) != kk

    def special_ok(j: int, T: float, need: np.ndarray) -> bool:
        """Feasible at T with the longest document on a replica of layout j."""
        room = T - tb.sync[j]
        if tb.alone[kk, j] > T or tb.size[j] > n_dev or room <= 0:
            return False
        xs = tb.x1[:, j] if theta[j] >= 1 else tb.x0[:, j]
        # the replica holding the longest document (its bubble floor is the largest)
        cap = float(capacity(room, tb.psi[kk, j], tb.q[j], tb.c0[j], tb.c0fb[j], tb.cv[j], tb.gamma[j], theta[j])) - xs[kk]
        if cap < 0:
            return False
        st = xs[others]
        elig = (tb.alone[others, j] <= T) & np.isfinite(st)
        forced = ~np.isfinite(need)
        if np.any(forced & ~elig):
            return False
        cap -= float(st[forced].sum())
        if cap < 0:
            return False
        rest = float(need[~forced].sum())
        cand = elig & ~forced & (st > 0)
        if cap > 0 and cand.any():
            # fill its spare time with the documents that save the most devices elsewhere
            ratio = need[cand] / st[cand]
            order = np.argsort(-ratio)
            c_sorted = st[cand][order]
            n_sorted = need[cand][order]
            cs = np.cumsum(c_sorted)
            full = int(np.searchsorted(cs, cap, side="right"))
            saved = float(n_sorted[:full].sum())
            if full < len(c_sorted):
                used = float(cs[full - 1]) if full > 0 else 0.0
                saved += n_sorted[full] * (cap - used) / c_sorted[full]
            rest -= saved
        return rest <= n_dev - tb.size[j] + 1e-9

    # each layout's condition is monotone in T, so is "some layout holds it"
    order = sorted((j for j in range(len(tb.layouts)) if np.isfinite(tb.alone[kk, j])), key=lambda j: tb.alone[kk, j])

    def any_special(T: float) -> bool:
        need = need_at(T)[others]
        return any(special_ok(j, T, need) for j in order if tb.alone[kk, j] <= T)

    return max(t0, _bisect(any_special, t0))


def _theta_py(tb: BoundTables, t1: float) -> np.ndarray:
    """Per layout, the micro-batch count argument that charges the batch more at t1 (the
    kernel `bound_theta` does the same)."""
    theta = np.ones(len(tb.layouts))
    for j in range(len(tb.layouts)):
        room = t1 - tb.sync[j]
        if tb.q[j] == 0 or room <= 0:
            continue
        fin = np.isfinite(tb.x0[:, j]) & (tb.alone[:, j] <= t1)
        if not fin.any():
            continue
        args = (room, tb.psi[fin, j], tb.q[j], tb.c0[j], tb.c0fb[j], tb.cv[j], tb.gamma[j])
        cap0, cap1 = capacity(*args, 0.0), capacity(*args, 1.0)
        if np.any(cap0 <= 0):
            continue
        if np.any(cap1 <= 0) or float((tb.x0[fin, j] / cap0).sum()) > float((tb.x1[fin, j] / cap1).sum()):
            theta[j] = 0.0
    return theta


def lower_bound(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None = None,
                tables: BoundTables | None = None, refine: bool = True, pipeline: bool = True,
                impl: str = "auto") -> float:
    """A time no plan of this batch can beat on this cluster (see the module docstring).

    refine: also use that the longest document sits on one replica of some layout L;
    that replica's devices run every other document they take at L's cost, not at each
    document's best one. pipeline: charge pipelines their provable bubble (False: only
    the memory-forced micro-batch constants and (pp-1) of them for fill and drain, the
    weaker bound kept for comparison). impl: "auto" (the C++ kernels where built) or
    "python" (the reference), equal bit for bit.
    """
    if len(lengths) == 0:
        return 0.0
    tb = tables or bound_tables(cm, lengths, layouts)
    n_dev = cm.cluster.num_gpus
    best_alone = tb.alone.min(axis=1)
    if not np.all(np.isfinite(best_alone)):
        bad = int(np.asarray(lengths)[~np.isfinite(best_alone)].max())
        raise ValueError(f"a sequence of {bad} tokens fits no layout of {cm.cluster.name}")
    k = len(tb.layouts)
    theta = np.ones(k)
    if not pipeline:
        tb = BoundTables(tb.x0, tb.x1, np.full_like(tb.psi, -np.inf), tb.alone, tb.sync, tb.layouts,
                         tb.size, tb.q, tb.c0, tb.c0fb, tb.cv, tb.gamma)
        return _solve(tb, n_dev, lengths, theta, refine, impl)
    # per layout, the micro-batch count argument that charges this batch more near its
    # bound (at the unrefined all-memory one); fixed before the search so that
    # feasibility stays monotone in T
    t1 = _solve(tb, n_dev, lengths, theta, False, impl)
    choose = kernel("bound_theta") if impl == "auto" else None
    if choose is not None:
        theta = choose(*_contiguous(tb.x0, tb.x1, tb.psi, tb.alone, tb.sync, tb.q, tb.c0, tb.c0fb, tb.cv, tb.gamma),
                       float(t1))
    else:
        theta = _theta_py(tb, t1)
    return max(t1, _solve(tb, n_dev, lengths, theta, refine, impl))

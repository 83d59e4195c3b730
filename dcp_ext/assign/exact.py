"""Exact references with HiGHS (optional `highspy`): the optimum plan for small instances
and a lower bound for large ones. For tests and benchmarks, never for planning.

exact_plan: the whole problem (assignment + packing) as one MILP. Symmetry between the
micro-batches of a replica is removed by naming each micro-batch after its
representative: sequences are sorted by (length desc, index asc), and micro-batch (r, k)
exists iff sequence k opens it (y[k,r] = x[k,r,k] = 1), holding only sequences after k.
    min z
    sum_{r,k} x[i,r,k] = 1                                   every sequence once
    x[i,r,k] <= x[k,r,k]                                     only into opened batches
    sum_i s_i x[i,r,k] <= max_mb_tokens_r * x[k,r,k]          token cap
    C[r,k] = o_r x[k,r,k] + sum_i cost_r(s_i) x[i,r,k]       micro-batch cost
    M_r >= C[r,k];   z >= sum_k C[r,k] + (pp_r - 1) M_r      replica_time <= z
Sequences longer than a replica's capacity get no variable on it. With a time limit the
result says whether optimality was proven and gives HiGHS's lower bound.

lp_lower_bound: min z over FRACTIONAL assignments where replica r spends, per sequence,
cost_r(s) + mb_overhead_r * s / max_mb_tokens_r (its share of the unavoidable
micro-batch overheads); with the largest single-sequence pipeline time
min_r pp_r * (cost_r(s) + o_r) it bounds every plan's makespan from below. For identical
replicas it is max(total cost / R, largest single cost). Given a plan's makespan as
`upper`, pipeline replicas also pay a valid linear share of their fill time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import ReplicaCost, estimate, replica_time_params, seq_cost
from .validate import check_fits, check_lengths, check_replicas


def _highspy():
    try:
        import highspy  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("dcp_ext.assign.exact needs highspy (pip install highspy)") from e
    return highspy


@dataclass
class ExactResult:
    micro_batches: list  # per replica: list of micro-batches (indices into lengths)
    replica_times: np.ndarray
    makespan: float  # replica_time-based makespan of the solution found
    lower_bound: float  # HiGHS's proven lower bound
    optimal: bool  # proven optimal (within mip_rel_gap)
    seconds: float


def _inputs(lengths, replicas):
    """(highspy, validated lengths, replica parameter tuples) for one exact problem."""
    hs = _highspy()
    arr = check_lengths(lengths, allow_empty=False)
    params = check_replicas(replicas)
    check_fits(arr, params)
    return hs, arr, params


def _solve(h, lp, time_limit: float, rel_gap: float, threads: int = 1):
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("threads", int(threads))
    h.passModel(lp)


class _LpBuilder:
    """Columns and row-wise constraints of a HiGHS model, assembled one by one."""

    def __init__(self, hs):
        self.hs = hs
        self.cols_lo, self.cols_hi, self.cost, self.integ = [], [], [], []
        self.rows_lo, self.rows_hi, self.starts, self.index, self.value = [], [], [0], [], []

    def new_col(self, lo, hi, c=0.0, integer=False) -> int:
        self.cols_lo.append(lo)
        self.cols_hi.append(hi)
        self.cost.append(c)
        vt = self.hs.HighsVarType
        self.integ.append(vt.kInteger if integer else vt.kContinuous)
        return len(self.cols_lo) - 1

    def add_row(self, lo, hi, entries) -> None:
        for j, v in entries:
            self.index.append(j)
            self.value.append(v)
        self.starts.append(len(self.index))
        self.rows_lo.append(lo)
        self.rows_hi.append(hi)

    def build(self, integer: bool = True):
        hs = self.hs
        lp = hs.HighsLp()
        lp.num_col_ = len(self.cols_lo)
        lp.num_row_ = len(self.rows_lo)
        lp.col_cost_ = np.asarray(self.cost)
        lp.col_lower_ = np.asarray(self.cols_lo)
        lp.col_upper_ = np.asarray(self.cols_hi)
        lp.row_lower_ = np.asarray(self.rows_lo)
        lp.row_upper_ = np.asarray(self.rows_hi)
        lp.a_matrix_.format_ = hs.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.value)
        if integer:
            lp.integrality_ = self.integ
        return lp


def exact_plan(lengths, replicas: list[ReplicaCost], *, time_limit: float = 10.0, rel_gap: float = 1e-6,
               start=None) -> ExactResult:
    """Optimal plan of the full problem; `start` (micro-batches per replica) seeds HiGHS."""
    hs, arr, params = _inputs(lengths, replicas)
    n, R = arr.size, len(params)
    L = arr.tolist()
    order = sorted(range(n), key=lambda i: -L[i])  # position -> sequence
    caps = [min(p[5], p[6]) for p in params]

    model = _LpBuilder(hs)
    new_col, add_row = model.new_col, model.add_row
    z = new_col(0.0, hs.kHighsInf, 1.0)
    x: dict[tuple[int, int, int], int] = {}  # (pos i, r, pos k) -> col
    Ccol: dict[tuple[int, int], int] = {}
    Mcol = [new_col(0.0, hs.kHighsInf) for _ in range(R)]
    for r in range(R):
        for k in range(n):
            if L[order[k]] > caps[r]:
                continue
            for i in range(k, n):
                if L[order[i]] <= caps[r]:
                    x[(i, r, k)] = new_col(0.0, 1.0, 0.0, True)
            Ccol[(r, k)] = new_col(0.0, hs.kHighsInf)

    inf = hs.kHighsInf
    by_item: dict[int, list[int]] = {i: [] for i in range(n)}
    by_bin: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (i, r, k), j in x.items():
        by_item[i].append(j)
        by_bin.setdefault((r, k), []).append((i, j))
    for i in range(n):
        add_row(1.0, 1.0, [(j, 1.0) for j in by_item[i]])
    for (r, k), members in by_bin.items():
        p = params[r]
        y = x[(k, r, k)]
        for i, j in members:
            if i != k:
                add_row(-inf, 0.0, [(j, 1.0), (y, -1.0)])
        tok = [(j, float(L[order[i]])) for i, j in members if i != k]
        if tok:
            add_row(-inf, 0.0, tok + [(y, float(L[order[k]] - p[6]))])
        ent = [(Ccol[(r, k)], 1.0)]
        for i, j in members:
            coef = -seq_cost(p, L[order[i]])
            if i == k:
                coef -= p[3]
            ent.append((j, coef))
        add_row(0.0, 0.0, ent)
        if p[4] > 1:
            add_row(0.0, inf, [(Mcol[r], 1.0), (Ccol[(r, k)], -1.0)])
    for r in range(R):  # cut: the micro-batch holding sequence i costs at least o + cost(i)
        p = params[r]
        if p[4] == 1:
            continue
        for i in range(n):
            ent = [(x[(i, r, k)], -(p[3] + seq_cost(p, L[order[i]]))) for k in range(i + 1) if (i, r, k) in x]
            if ent:
                add_row(0.0, inf, [(Mcol[r], 1.0)] + ent)
    for r in range(R):  # identical replicas: loads in index order (symmetry breaking)
        twin = next((rr for rr in range(r + 1, R) if params[rr] == params[r]), None)
        if twin is not None:
            add_row(0.0, inf, [(Ccol[(r, k)], 1.0) for (rr, k) in Ccol if rr == r]
                    + [(Ccol[(twin, k)], -1.0) for (rr, k) in Ccol if rr == twin])
    for r in range(R):
        ent = [(z, 1.0), (Mcol[r], -float(params[r][4] - 1))]
        ent += [(Ccol[(rr, k)], -1.0) for (rr, k) in Ccol if rr == r]
        add_row(0.0, inf, ent)

    lp = model.build()
    h = hs.Highs()
    _solve(h, lp, time_limit, rel_gap)
    if start is not None:
        sol = _start_vector(start, order, x, Ccol, Mcol, z, params, L, lp.num_col_)
        if sol is not None:
            s = hs.HighsSolution()
            s.col_value = list(sol)
            s.value_valid = True
            h.setSolution(s)
    h.run()
    info = h.getInfo()
    status = h.getModelStatus()
    vals = h.getSolution().col_value
    mbs: list[list[list[int]]] = [[] for _ in range(R)]
    for (r, k) in Ccol:
        if vals[x[(k, r, k)]] > 0.5:
            mb = sorted(order[i] for i, j in by_bin[(r, k)] if vals[j] > 0.5)
            mbs[r].append(mb)
    times = np.array([replica_time_params(params[r], L, mbs[r]) for r in range(R)])
    return ExactResult(micro_batches=mbs, replica_times=times, makespan=float(times.max()),
                       lower_bound=float(info.mip_dual_bound),
                       optimal=status == hs.HighsModelStatus.kOptimal, seconds=float(h.getRunTime()))


@dataclass
class ExactBalanceResult:
    assignment: np.ndarray  # replica of each sequence
    replica_times: np.ndarray  # model.estimate of each replica under that assignment
    makespan: float  # max of replica_times (recomputed, not HiGHS's objective)
    lower_bound: float
    optimal: bool
    seconds: float


def exact_balance(lengths, replicas: list[ReplicaCost], *, time_limit: float = 10.0, rel_gap: float = 1e-6,
                  start=None) -> ExactBalanceResult:
    """Optimal stage-1 assignment: min over assignments of max_r estimate_r.

    estimate_r = W + q*o + min over v in [ceil(T/cap), n_r] of v*o + q*max(W/v, m), so a
    binary y[r,v] picks the micro-batch count (y[r,0]: replica empty):
        sum_v y[r,v] = 1,  x[i,r] <= 1 - y[r,0],  sum_v v*y[r,v] <= sum_i x[i,r],
        T_r <= cap_r * sum_v v*y[r,v],  m_r >= cost_r(s_i) x[i,r],
        z >= W_r + o_r * sum_v v*y[r,v]                                     (pp == 1)
        z >= W_r + q*o*(1 - y[r,0]) + o*sum_v v*y[r,v] + q*m_r              (pp > 1)
        z >= W_r + q*o + v*o + q*W_r/v - BigM_v*(1 - y[r,v])   for v >= 1   (pp > 1)
    Because the estimate never exceeds replica_time, this optimum is a LOWER BOUND of the
    best makespan any plan (assignment + packing) can reach. `start` is an assignment.
    """
    hs, arr, params = _inputs(lengths, replicas)
    n, R = arr.size, len(params)
    L = arr.tolist()
    caps = [min(p[5], p[6]) for p in params]
    inf = hs.kHighsInf
    model = _LpBuilder(hs)
    new_col, add_row = model.new_col, model.add_row
    z = new_col(0.0, inf, 1.0)
    x = {(i, r): new_col(0.0, 1.0, 0.0, True) for r in range(R) for i in range(n) if L[i] <= caps[r]}
    for i in range(n):
        add_row(1.0, 1.0, [(x[(i, r)], 1.0) for r in range(R) if (i, r) in x])
    for r, p in enumerate(params):
        o, q, cap = p[3], p[4] - 1, p[6]
        elig = [i for i in range(n) if (i, r) in x]
        c = {i: seq_cost(p, L[i]) for i in elig}
        y = [new_col(0.0, 1.0, 0.0, True) for _ in range(len(elig) + 1)]
        Wmax = sum(c.values())
        add_row(1.0, 1.0, [(yv, 1.0) for yv in y])
        for i in elig:
            add_row(-inf, 1.0, [(x[(i, r)], 1.0), (y[0], 1.0)])
        vsum = [(y[v], float(v)) for v in range(1, len(y))]
        add_row(0.0, inf, [(x[(i, r)], 1.0) for i in elig] + [(yv, -w) for yv, w in vsum])
        add_row(0.0, inf, [(yv, cap * w) for yv, w in vsum] + [(x[(i, r)], -float(L[i])) for i in elig])
        W = [(x[(i, r)], -c[i]) for i in elig]
        if q == 0:
            add_row(0.0, inf, [(z, 1.0)] + W + [(yv, -o * w) for yv, w in vsum])
            continue
        m = new_col(0.0, inf)
        for i in elig:
            add_row(0.0, inf, [(m, 1.0), (x[(i, r)], -c[i])])
        add_row(q * o, inf, [(z, 1.0)] + W + [(yv, -o * w) for yv, w in vsum] + [(m, -q), (y[0], q * o)])
        for v in range(1, len(y)):
            big = Wmax + q * Wmax / v + q * o + v * o
            add_row(q * o + v * o - big, inf,
                    [(z, 1.0)] + [(x[(i, r)], -c[i] * (1.0 + q / v)) for i in elig] + [(y[v], -big)])

    lp = model.build()
    h = hs.Highs()
    _solve(h, lp, time_limit, rel_gap)
    if start is not None:
        s = hs.HighsSolution()
        s.col_value = [0.0] * lp.num_col_
        for i, r in enumerate(np.asarray(start).tolist()):
            s.col_value[x[(i, r)]] = 1.0
        s.value_valid = True
        h.setSolution(s)  # partial values: HiGHS completes the rest
    h.run()
    vals = h.getSolution().col_value
    assignment = np.array([max((r for r in range(R) if (i, r) in x), key=lambda r: vals[x[(i, r)]])
                           for i in range(n)], dtype=np.int64)
    times = np.array([_estimate_of(params[r], [L[i] for i in range(n) if assignment[i] == r]) for r in range(R)])
    return ExactBalanceResult(assignment=assignment, replica_times=times, makespan=float(times.max()),
                              lower_bound=float(h.getInfo().mip_dual_bound),
                              optimal=h.getModelStatus() == hs.HighsModelStatus.kOptimal,
                              seconds=float(h.getRunTime()))


def _estimate_of(p: tuple, lens: list[int]) -> float:
    if not lens:
        return 0.0
    lens = sorted(lens, reverse=True)
    W = 0.0
    for s in lens:
        W += seq_cost(p, s)
    return estimate(p, W, sum(lens), seq_cost(p, lens[0]), len(lens))


def _start_vector(start, order, x, Ccol, Mcol, z, params, L, ncol):
    """Column values of a given plan (micro-batches per replica), or None if it does not fit."""
    pos = {seq: p for p, seq in enumerate(order)}
    v = [0.0] * ncol
    worst = 0.0
    for r, mbs in enumerate(start):
        p = params[r]
        total, largest = 0.0, 0.0
        for mb in mbs:
            if not mb:
                continue
            k = min(pos[i] for i in mb)
            if (r, k) not in Ccol:
                return None
            cst = p[3]
            for i in mb:
                if (pos[i], r, k) not in x:
                    return None
                v[x[(pos[i], r, k)]] = 1.0
                cst += seq_cost(p, L[i])
            v[Ccol[(r, k)]] = cst
            total += cst
            largest = max(largest, cst)
        v[Mcol[r]] = largest
        worst = max(worst, total + (p[4] - 1) * largest)
    v[z] = worst
    return v


def lp_lower_bound(lengths, replicas: list[ReplicaCost], upper: float | None = None) -> float:
    """Makespan lower bound for any plan (module docstring); exact LP via HiGHS.

    With `upper`, the makespan of any valid plan, pipeline replicas also get the chord of
    their fill cost: a replica with pp > 1 doing work W (sequence costs) takes at least
    g(W) = W + q*o + 2*sqrt(q*o*W) (v*o + q*W/v >= 2*sqrt(q*o*W)); g is concave with
    g(0) >= 0, so on [0, upper] it lies above the chord W * g(upper) / upper, and no
    replica of a plan better than `upper` does more work than upper.
    """
    hs, arr, params = _inputs(lengths, replicas)
    n, R = arr.size, len(params)
    L = arr.tolist()
    single = max(min(p[4] * (seq_cost(p, s) + p[3]) for p in params if s <= min(p[5], p[6])) for s in L)
    # aggregate equal lengths: one column per (distinct length, replica)
    uniq, counts = np.unique(arr, return_counts=True)
    model = _LpBuilder(hs)
    z = model.new_col(0.0, hs.kHighsInf, 1.0)
    xcols = []
    for u, cnt in zip(uniq.tolist(), counts.tolist()):
        cols = [(r, model.new_col(0.0, float(cnt)), seq_cost(p, u) + p[3] * u / p[6])
                for r, p in enumerate(params) if u <= min(p[5], p[6])]
        xcols.append(cols)
        model.add_row(float(cnt), float(cnt), [(j, 1.0) for _, j, _ in cols])
    for r in range(R):
        model.add_row(0.0, hs.kHighsInf, [(z, 1.0)] + [(j, -w) for cols in xcols for rr, j, w in cols if rr == r])
        p = params[r]
        q, o = p[4] - 1, p[3]
        if upper is not None and upper > 0.0 and q > 0:
            slope = (upper + q * o + 2.0 * (q * o * upper) ** 0.5) / upper
            model.add_row(0.0, hs.kHighsInf, [(z, 1.0)] + [(j, -slope * seq_cost(p, u)) for u, cols in
                                                          zip(uniq.tolist(), xcols) for rr, j, _ in cols if rr == r])
    lp = model.build(integer=False)
    h = hs.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(lp)
    h.run()
    frac = float(h.getInfo().objective_function_value)
    out = max(frac, single)
    return out if upper is None else min(out, upper)

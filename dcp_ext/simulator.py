"""Time of one iteration from its plan, and a lower bound no plan can beat.

Why it exists: planners are compared (and checked) here, with one cost model, so that a
speedup means "the same work on the same machine, placed better". Pure: lengths, specs
and plans in, seconds out.

Iteration model (matches the runtime's structure in DESIGN.md): every replica pulls its
parameters from the fixed optimizer sharding, runs its micro-batches through a 1F1B
pipeline (simulated event by event, micro-batches of different sizes included), then
pushes its gradients back; replicas run in parallel and the slowest decides:

    T = max over replicas (sync(replica) + pipeline(replica))

Lower bound (`lower_bound`): a relaxation of every plan any planner can emit on this
cluster (all layouts, all recompute choices): documents split perfectly over devices,
each at its cheapest layout (additive part of the cost only: no micro-batch constant, no
unhidden CP exchange, no pipeline bubble), every device paying the receive side of its
layout's sync, and the iteration no shorter than any document alone on the replica that
runs it fastest. Each dropped term is >= 0 in the simulated time, hence a true bound.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from dcp_ext.cost_model import CostModel, Layout
from dcp_ext.plan import IterationPlan, ReplicaPlan


# ---------------------------------------------------------------------------- 1F1B
@dataclass
class PipelineResult:
    makespan: float
    # (stage, micro-batch, kind 'F'/'B', start, end) for timelines
    events: list[tuple[int, int, str, float, float]] = field(default_factory=list)


@functools.lru_cache(maxsize=4096)
def _schedule(m: int, pp: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A dependency-respecting global order of the 1F1B ops for m micro-batches on pp
    stages, as parallel tuples (stage, micro-batch, is_backward, dependency slot); slots
    are positions in this order, -1 means no dependency."""
    orders = []
    for j in range(pp):
        w = min(pp - 1 - j, m)
        seq = [i for i in range(w)]  # forwards as i, backwards as ~i
        nf, nb = w, 0
        while nf < m:
            seq.append(nf)
            seq.append(~nb)
            nf += 1
            nb += 1
        while nb < m:
            seq.append(~nb)
            nb += 1
        orders.append(seq)
    slot_f = [[-1] * m for _ in range(pp)]
    slot_b = [[-1] * m for _ in range(pp)]
    st, mb, kd, dp = [], [], [], []
    ptr = [0] * pp
    lens = [len(o) for o in orders]
    remaining = sum(lens)
    last = pp - 1
    while remaining:
        progressed = False
        for j in range(pp):
            seq, p, sf, sb = orders[j], ptr[j], slot_f[j], slot_b[j]
            while p < lens[j]:
                x = seq[p]
                if x >= 0:
                    dep = slot_f[j - 1][x] if j else -1
                    if j and dep < 0:
                        break
                    sf[x] = len(st)
                    st.append(j), mb.append(x), kd.append(0), dp.append(dep)
                else:
                    i = ~x
                    dep = sf[i] if j == last else slot_b[j + 1][i]
                    if dep < 0:
                        break
                    sb[i] = len(st)
                    st.append(j), mb.append(i), kd.append(1), dp.append(dep)
                p += 1
                remaining -= 1
                progressed = True
            ptr[j] = p
        if not progressed:  # pragma: no cover - the schedule is acyclic
            raise RuntimeError("1F1B schedule deadlocked")
    return tuple(st), tuple(mb), tuple(kd), tuple(dp)


def one_f_one_b(fwd: Sequence[float], bwd: Sequence[float], pp: int, record: bool = False) -> PipelineResult:
    """Event simulation of the non-interleaved 1F1B schedule with identical stages.

    Stage j runs min(pp-1-j, m) warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. F(i, j) waits for F(i, j-1); B(i, j)
    waits for B(i, j+1) (and, on the last stage, for F(i, j)).
    """
    m = len(fwd)
    if m == 0:
        return PipelineResult(0.0)
    if pp == 1:
        t = 0.0
        ev = []
        for i in range(m):
            if record:
                ev.append((0, i, "F", t, t + fwd[i]))
                ev.append((0, i, "B", t + fwd[i], t + fwd[i] + bwd[i]))
            t += fwd[i] + bwd[i]
        return PipelineResult(t, ev)
    st, mb, kd, dp = _schedule(m, pp)
    end = [0.0] * len(st)
    clock = [0.0] * pp
    events = []
    for k in range(len(st)):
        j, i, dep = st[k], mb[k], dp[k]
        start = clock[j]
        if dep >= 0 and end[dep] > start:
            start = end[dep]
        e = start + (bwd[i] if kd[k] else fwd[i])
        end[k] = e
        clock[j] = e
        if record:
            events.append((j, i, "B" if kd[k] else "F", start, e))
    return PipelineResult(max(clock), events)


# ---------------------------------------------------------------------------- one iteration
@dataclass
class ReplicaResult:
    layout: Layout
    ranks: list[int]
    sync_s: float
    pipeline_s: float
    peak_bytes: float
    mb_stage_s: list[float]

    @property
    def time_s(self) -> float:
        return self.sync_s + self.pipeline_s


@dataclass
class IterationResult:
    time_s: float
    replicas: list[ReplicaResult]
    peak_bytes: float
    memory_ok: bool  # every replica within the planning capacity (device memory less margin)
    tokens: int
    peak_memory_fraction: float  # peak predicted bytes / device memory


def micro_batch_order_time(cm: CostModel, layout: Layout, mbs: Sequence[tuple[float, float, int, int]]) -> tuple[float, list[float], list[float]]:
    """(pipeline time, fwd list, bwd list) for micro-batches given as (S2, T, n, rs) in order."""
    fwd, bwd = [], []
    for s2, t, n, rs in mbs:
        f, b = cm.coeffs(layout, rs).mb_fwd_bwd(s2, t, n)
        fwd.append(f)
        bwd.append(b)
    return one_f_one_b(fwd, bwd, layout.pp).makespan, fwd, bwd


def simulate_replica(cm: CostModel, rep: ReplicaPlan, length_of: Mapping[int, int], num_replicas: int) -> ReplicaResult:
    layout = Layout(rep.tp, rep.cp, rep.pp)
    mbs = []
    tokens, rss = [], []
    for mb in rep.micro_batches:
        s = np.fromiter((length_of[i] for i in mb.sample_ids), dtype=float, count=len(mb.sample_ids))
        rs = cm.stage_recompute(layout, mb.recompute_layers)
        mbs.append((float(np.dot(s, s)), float(s.sum()), len(s), rs))
        tokens.append(float(s.sum()))
        rss.append(rs)
    pipe, fwd, bwd = micro_batch_order_time(cm, layout, mbs)
    return ReplicaResult(
        layout=layout,
        ranks=list(rep.ranks),
        sync_s=cm.sync_time(layout, num_replicas),
        pipeline_s=pipe,
        peak_bytes=cm.replica_peak_bytes(layout, tokens, rss),
        mb_stage_s=[f + b for f, b in zip(fwd, bwd)],
    )


def simulate_iteration(cm: CostModel, it: IterationPlan, length_of: Mapping[int, int]) -> IterationResult:
    """Simulated time of one planned iteration. `length_of[sample_id]` is the (truncated)
    length of each sample of the batch."""
    reps = [simulate_replica(cm, r, length_of, len(it.replicas)) for r in it.replicas]
    t = max((r.time_s for r in reps), default=0.0)
    peak = max((r.peak_bytes for r in reps), default=0.0)
    return IterationResult(
        time_s=t,
        replicas=reps,
        peak_bytes=peak,
        memory_ok=peak <= cm.capacity_bytes * (1 + 1e-9),
        tokens=int(sum(length_of[i] for i in it.sample_ids)),
        peak_memory_fraction=peak / cm.cluster.gpu.memory_bytes,
    )


# ---------------------------------------------------------------------------- lower bound
@dataclass
class BoundTables:
    """Per (document, layout) numbers the bound needs, for one batch."""

    gpu_seconds: np.ndarray  # [n_docs, n_layouts] g * additive stage cost, inf if it cannot hold
    alone: np.ndarray  # [n_docs, n_layouts] pp * stage time of the document alone (+ sync)
    sync: np.ndarray  # [n_layouts] receive-side sync per device
    layouts: list[Layout]


def bound_tables(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None = None) -> BoundTables:
    """Per document and layout: the fewest device-seconds it can cost, and its time alone.

    Device-seconds of a document on a layout: g * min over recompute levels rs that hold it
    of [additive stage cost at rs + c0 * pp * keep(rs) * s / free]. The second term is the
    micro-batch constant the document must share: 1F1B holds pp consecutive micro-batches
    in flight on stage 0, so the kept activations of any pp consecutive ones fit in the
    free memory; a replica whose documents keep S bytes in all therefore runs at least
    pp*S/free - (pp-1) micro-batches, each costing at least c0 (the cheapest constant of
    the layout), and its pipeline fill and drain cost at least (pp-1)*c0 more: together
    at least c0*pp*S/free on top of the additive costs.
    """
    layouts = list(layouts) if layouts is not None else cm.all_layouts()
    s = np.asarray(lengths, dtype=float)
    n, k = len(s), len(layouts)
    gs = np.full((n, k), np.inf)
    alone = np.full((n, k), np.inf)
    sync = np.empty(k)
    for j, lay in enumerate(layouts):
        c0_min = cm.coeffs(lay, 0).c0  # the cheapest micro-batch constant of this layout
        sync[j] = cm.sync_time(lay, None)
        Ls = cm.layers_per_stage(lay)
        free = cm.capacity_bytes - cm.state_bytes(lay)
        if free <= 0:
            continue
        # smallest recompute that holds each document alone (monotone in rs)
        caps = np.array([cm.max_tokens(lay, rs, 1) for rs in range(Ls + 1)])
        caps = np.maximum.accumulate(caps)
        rs_min = np.searchsorted(caps, s, side="left")  # first rs with cap >= s
        best = np.full(n, np.inf)
        for rs in range(int(rs_min.min()) if n else 0, Ls + 1):
            sel = rs_min <= rs
            if not sel.any():
                continue
            co = cm.coeffs(lay, rs)
            keep = cm.act_bytes_per_token(lay, rs)[0]
            per_token_share = c0_min * lay.pp * keep / free
            ss = s[sel]
            cost = co.doc_cost(ss) + per_token_share * ss
            best[sel] = np.minimum(best[sel], cost)
        gs[:, j] = lay.size * best
        for rs in np.unique(rs_min):
            if rs > Ls:
                continue
            sel = rs_min == rs
            co = cm.coeffs(lay, int(rs))
            ss = s[sel]
            alone[sel, j] = lay.pp * co.mb_time(ss * ss, ss, 1) + cm.sync_time(lay, None)
    return BoundTables(gs, alone, sync, layouts)


def _bisect(feasible, lo: float, hi: float | None = None, rel: float = 1e-7) -> float:
    """Smallest T in [lo, inf) with feasible(T) (monotone), to relative precision `rel`."""
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
    return hi


def lower_bound(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None = None,
                tables: BoundTables | None = None, refine: bool = True) -> float:
    """A time no plan of this batch can beat on this cluster (see the module docstring).

    refine: also use that the longest document sits on one replica of some layout L;
    that replica's devices run every other document they take at L's cost, not at each
    document's best one. The bound is then the least, over the layouts L able to run the
    longest document in time, of the relaxation with that one replica fixed (its spare
    time filled fractionally with the documents that save the most devices elsewhere).
    """
    if len(lengths) == 0:
        return 0.0
    tb = tables or bound_tables(cm, lengths, layouts)
    n_dev = cm.cluster.num_gpus
    best_alone = tb.alone.min(axis=1)
    if not np.all(np.isfinite(best_alone)):
        bad = int(np.asarray(lengths)[~np.isfinite(best_alone)].max())
        raise ValueError(f"a sequence of {bad} tokens fits no layout of {cm.cluster.name}")
    lo = float(best_alone.max())

    def need_at(T: float) -> np.ndarray:
        room = T - tb.sync
        ok = (tb.alone <= T) & (room > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.where(ok, tb.gpu_seconds / np.where(room > 0, room, 1.0), np.inf)
        return need.min(axis=1)

    t0 = _bisect(lambda T: float(need_at(T).sum()) <= n_dev, lo)
    n = len(lengths)
    if not refine or n < 2:
        return t0
    k = int(np.argmax(np.asarray(lengths)))
    others = np.arange(n) != k
    sizes = np.array([l.size for l in tb.layouts], dtype=float)

    def feasible_special(j: int, T: float) -> bool:
        if tb.alone[k, j] > T or sizes[j] > n_dev:
            return False
        stage = tb.gpu_seconds[:, j] / sizes[j]  # replica seconds each document costs on j
        cap = T - tb.sync[j] - stage[k]
        if cap < 0:
            return False
        need = need_at(T)[others]
        st = stage[others]
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
        return rest <= n_dev - sizes[j] + 1e-9

    order = sorted((j for j in range(len(tb.layouts)) if np.isfinite(tb.alone[k, j])), key=lambda j: tb.alone[k, j])
    best = math.inf
    for j in order:
        if math.isfinite(best) and not feasible_special(j, best):
            continue  # this layout cannot beat the best found so far
        t = _bisect(lambda T: feasible_special(j, T), max(t0, float(tb.alone[k, j])), None if not math.isfinite(best) else best)
        best = min(best, t)
    return max(t0, best) if math.isfinite(best) else t0

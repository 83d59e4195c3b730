"""Time of one iteration from its plan, and a lower bound no plan can beat.

Why it exists: planners are compared (and checked) here, with one cost model, so that a
speedup means "the same work on the same machine, placed better". Pure: lengths, specs
and plans in, seconds out.

Iteration model (matches the runtime's structure in docs/contracts.md): every replica pulls its
parameters from the fixed optimizer sharding, runs its micro-batches through a 1F1B
pipeline (simulated event by event, micro-batches of different sizes included), then
pushes its gradients back; replicas run in parallel and the slowest decides:

    T = max over replicas (sync(replica) + pipeline(replica))

Lower bound (`lower_bound`, in `dcp_ext.planning.bound`): a relaxation of every plan any planner
can emit on this cluster (all layouts, all recompute choices): documents split perfectly
over devices, each at its cheapest layout (additive part of the cost), every device paying
the receive side of its layout's sync, micro-batch constants forced by memory, pipelines
their bubble as proven on this module's 1F1B, and the iteration no shorter than any
document alone on the replica that runs it fastest.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan, ReplicaPlan


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
    return one_f_one_b_stages([fwd] * pp, [bwd] * pp, pp, record)


def one_f_one_b_stages(fwd: Sequence[Sequence[float]], bwd: Sequence[Sequence[float]], pp: int,
                       record: bool = False) -> PipelineResult:
    """`one_f_one_b` with stages of their own: fwd[j][i], bwd[j][i] are stage j's times of
    micro-batch i (uneven stages, layer strategies). Identical stages give `one_f_one_b`'s
    makespan."""
    m = len(fwd[0]) if pp else 0
    if m == 0:
        return PipelineResult(0.0)
    if pp == 1:
        return one_f_one_b(fwd[0], bwd[0], 1, record)
    st, mb, kd, dp = _schedule(m, pp)
    end = [0.0] * len(st)
    clock = [0.0] * pp
    events = []
    for k in range(len(st)):
        j, i, dep = st[k], mb[k], dp[k]
        start = clock[j]
        if dep >= 0 and end[dep] > start:
            start = end[dep]
        e = start + (bwd[j][i] if kd[k] else fwd[j][i])
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
    if rep.uses_v2():
        return simulate_replica_v2(cm, rep, length_of, num_replicas)
    layout = Layout(rep.tp, rep.cp, rep.pp)
    # memory: each micro-batch's documents as the runtime pads them. Where memory is quadratic
    # in their lengths (the CPU) the padded micro-batch is what is checked, tokens included;
    # elsewhere the lengths change nothing and the tokens stay the real ones (as GPU plans
    # have always been checked)
    quadratic = cm.quadratic(layout)
    mbs = []
    tokens, rss, lengths = [], [], []
    for mb in rep.micro_batches:
        s = np.fromiter((length_of[i] for i in mb.sample_ids), dtype=float, count=len(mb.sample_ids))
        rs = cm.stage_recompute(layout, mb.recompute_layers)
        mbs.append((float(np.dot(s, s)), float(s.sum()), len(s), rs))
        padded = cm.padded_lengths(layout, [length_of[i] for i in mb.sample_ids])
        tokens.append(float(sum(padded)) if quadratic else float(s.sum()))
        lengths.append(padded)
        rss.append(rs)
    pipe, fwd, bwd = micro_batch_order_time(cm, layout, mbs)
    return ReplicaResult(
        layout=layout,
        ranks=list(rep.ranks),
        sync_s=cm.sync_time(layout, num_replicas),
        pipeline_s=pipe,
        peak_bytes=cm.replica_peak_bytes(layout, tokens, rss, mb_lengths=lengths),
        mb_stage_s=[f + b for f, b in zip(fwd, bwd)],
    )


def replica_stage_times(cm: CostModel, rep: ReplicaPlan, length_of: Mapping[int, int]) -> tuple[list, list]:
    """fwd[stage][micro-batch], bwd[stage][micro-batch] seconds of a (v2) replica's plan;
    micro-batches of the same recompute and layer strategies are priced together."""
    from dcp_ext.planning.layer_cost import stage_times_arrays

    lp = layer_prices(cm)
    layout = Layout(rep.tp, rep.cp, rep.pp)
    m = len(rep.micro_batches)
    stats = np.empty((3, m))
    groups: dict = {}
    for i, mb in enumerate(rep.micro_batches):
        s = np.fromiter((length_of[j] for j in mb.sample_ids), dtype=float, count=len(mb.sample_ids))
        stats[:, i] = (float(np.dot(s, s)), float(s.sum()), len(s))
        key = (mb.recompute_layers, tuple(mb.layer_strategies) if mb.layer_strategies else None)
        groups.setdefault(key, []).append(i)
    F = np.empty((rep.pp, m))
    B = np.empty((rep.pp, m))
    for (R, strategies), idx in groups.items():
        f, b = stage_times_arrays(lp, layout, rep.stage_layers, stats[0, idx], stats[1, idx], stats[2, idx], R,
                                  list(strategies) if strategies else None)
        F[:, idx], B[:, idx] = f, b
    return F.tolist(), B.tolist()


def layer_prices(cm: CostModel):
    """The cost model's LayerPrices (one per cost model, cleared when it recalibrates)."""
    from dcp_ext.planning.layer_cost import LayerPrices

    if cm.layer_price_cache is None:
        cm.layer_price_cache = LayerPrices(cm)
    return cm.layer_price_cache


def v2_padded_lengths(cm: CostModel, rep: ReplicaPlan, lengths: Sequence[int], strategies=None) -> list[int]:
    """A v2 micro-batch's documents as the runtime pads them: each to a multiple of
    2*lcm(cp of every strategy in the replica's micro-batches) when any cp > 1, the total to
    tp*cp with sequence parallelism when any strategy has tp > 1. `strategies`: the
    replica's (tp, cp) set, when the caller has it."""
    from dcp_ext.data.lengths import round_up

    if strategies is None:
        strategies = {(rep.tp, rep.cp)} | {(s.tp, s.cp) for mb in rep.micro_batches for s in mb.layer_strategies or ()}
    c = 1
    for _, cp in strategies:
        c = math.lcm(c, cp)
    each = 2 * c if c > 1 else 1
    n = rep.tp * rep.cp
    total = n if (cm.model.sequence_parallel and any(tp > 1 for tp, _ in strategies)) else 1
    out = [round_up(int(x), each) for x in lengths]
    if out:
        whole = sum(out)
        out[-1] += round_up(whole, math.lcm(each, total)) - whole
    return out


def simulate_replica_v2(cm: CostModel, rep: ReplicaPlan, length_of: Mapping[int, int], num_replicas: int) -> ReplicaResult:
    """A replica with stage_layers or layer strategies: every stage priced on its own
    (`dcp_ext.planning.layer_cost`, `dcp_ext.planning.layer_memory`)."""
    from dcp_ext.planning.layer_memory import replica_peak_v2

    layout = Layout(rep.tp, rep.cp, rep.pp)
    quadratic = cm.quadratic(layout)
    fwd, bwd = replica_stage_times(cm, rep, length_of)
    strategies = {(rep.tp, rep.cp)} | {(s.tp, s.cp) for mb in rep.micro_batches for s in mb.layer_strategies or ()}
    mem = []
    for mb in rep.micro_batches:
        real = [length_of[i] for i in mb.sample_ids]
        padded = v2_padded_lengths(cm, rep, real, strategies)
        mem.append((float(sum(padded)) if quadratic else float(sum(real)), mb.recompute_layers, mb.layer_strategies,
                    padded))
    pipe = one_f_one_b_stages(fwd, bwd, rep.pp).makespan
    return ReplicaResult(
        layout=layout,
        ranks=list(rep.ranks),
        sync_s=cm.sync_time(layout, num_replicas),
        pipeline_s=pipe,
        peak_bytes=replica_peak_v2(cm, layout, rep.stage_layers, mem),
        mb_stage_s=[max(fwd[j][i] + bwd[j][i] for j in range(rep.pp)) for i in range(len(rep.micro_batches))],
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
from dcp_ext.planning.bound import BoundTables, bound_tables, lower_bound  # noqa: E402,F401  (re-exported)

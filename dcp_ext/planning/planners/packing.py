"""One replica's share of a batch packed into micro-batches, fitted to memory and priced;
a set of packed replicas turned into the iteration plan.

Why a module of its own: every planner packs and prices a replica the same way (the C++
kernel where it is built, its Python reference otherwise); only where documents go differs.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dcp_ext.kernels import kernel
from dcp_ext.planning.cost_model import ATTN_BWD_FACTOR, CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
from dcp_ext.planning.planners.doc_memory import BinCheck, bin_check, fits_alone, level_bytes
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.tables import TypeTable
from dcp_ext.planning.simulator import one_f_one_b


@dataclass
class PackedReplica:
    layout: Layout
    ranks: list[int]
    micro_batches: list[tuple[list[int], int]]  # (doc positions, rs)
    time_s: float = 0.0  # pipeline + sync
    pipeline_s: float = 0.0
    sync_s: float = 0.0
    peak_bytes: float = 0.0
    # plan contract v2 (dcp_ext.planning.planners.layer_plan): the replica's stage split and
    # each micro-batch's layer strategies (None: even stages, the replica's (tp, cp) everywhere)
    stage_layers: tuple[int, ...] | None = None
    layer_strategies: list | None = None


def first_fit_decreasing(docs: Sequence[int], sizes: np.ndarray, cap: float,
                         check: BinCheck | None = None) -> list[list[int]]:
    """Bins of total size <= cap (a larger item gets a bin of its own); with `check`, only
    bins it accepts (a memory check of the bin's documents, see doc_memory.BinCheck).
    Without a check the C++ kernel (csrc/planner.cpp) packs, where built; this is its reference."""
    if check is None and len(docs) > 1:
        ffd = kernel("first_fit_decreasing")
        if ffd is not None:
            return ffd(np.asarray(docs, dtype=np.int64), np.array([sizes[d] for d in docs], dtype=float), float(cap))
    order = sorted(docs, key=lambda d: -sizes[d])
    bins: list[list[int]] = []
    room: list[float] = []
    for d in order:
        x = sizes[d]
        for i, r in enumerate(room):
            if x <= r and (check is None or check.fits(i, bins[i] + [d])):
                bins[i].append(d)
                room[i] = r - x
                break
        else:
            i = len(bins)
            bins.append([d])
            room.append(cap - x)
        if check is not None:
            check.put(i, bins[i])
    return bins


def pack_replica(
    cm: CostModel,
    tt: TypeTable,
    s: np.ndarray,
    docs: Sequence[int],
    stage_cost: np.ndarray | None = None,
    target_mbs: int | None = None,
) -> list[tuple[list[int], int]]:
    """Micro-batches (doc positions, recompute layers per stage) for one replica.

    pp == 1: documents that fit without recompute are packed first-fit-decreasing into
    micro-batches of at most `cap_mb` tokens (fewest micro-batches = fewest constants);
    a longer document runs alone with the least recompute that holds it.
    pp > 1: as many micro-batches as balance bubble against per-micro-batch constant
    (or `target_mbs`), filled longest-processing-time first so their costs match.
    Quadratic layouts (CPU attention): "fits without recompute" is the exact check of the
    document, and every micro-batch must also pass the exact check of its documents.
    """
    if not docs:
        return []
    cap = tt.cap_mb
    solo = tt.doc_caps[0] if tt.quadratic else cap  # longest document packed without recompute
    long_docs = [d for d in docs if s[d] > solo]
    short = [d for d in docs if s[d] <= solo]
    check = bin_check(cm, tt.layout, s, 0, tt.allowed_rs[-1], [[d] for d in long_docs])
    mbs: list[tuple[list[int], int]] = []
    for d in long_docs:
        rs = tt.rs_planned(float(s[d]))
        if rs is None:
            raise PlanningError(f"a sequence of {int(s[d])} tokens does not fit {tt.layout} (longest {int(tt.max_doc)})")
        mbs.append(([d], rs))
    if short:
        if tt.pp == 1:
            for b in first_fit_decreasing(short, s, cap, check):
                mbs.append((b, 0))
        else:
            co = cm.coeffs(tt.layout, 0)
            cost = stage_cost if stage_cost is not None else None
            w = float(sum((cost[d] if cost is not None else co.b * s[d]) for d in short))
            tokens = float(sum(s[d] for d in short))
            m_mem = math.ceil(1.0 * tokens / cap) if cap > 0 else len(short)  # slack: bins rarely hit the cap
            m_opt = int(round(math.sqrt((tt.pp - 1) * w / co.c0))) if co.c0 > 0 else len(short)
            m = target_mbs if target_mbs else max(m_mem, m_opt, 1)
            m = max(1, min(m, len(short)))
            # longest processing time first into the least loaded bin with token room
            bins: list[list[int]] = [[] for _ in range(m)]
            heap = [(0.0, i, 0.0) for i in range(m)]  # (load, bin, tokens)
            for d in sorted(short, key=lambda d: -s[d]):
                x = float(s[d])
                c = cost[d] if cost is not None else co.b * x + co.a * x * x

                def takes(entry) -> bool:
                    return entry[2] + x <= cap and (check is None or check.fits(entry[1], bins[entry[1]] + [d]))

                aside = []
                while heap and not takes(heap[0]) and len(aside) < 8:
                    aside.append(heapq.heappop(heap))
                if heap and takes(heap[0]):
                    load, i, tok = heapq.heappop(heap)
                else:
                    bins.append([])
                    load, i, tok = 0.0, len(bins) - 1, 0.0
                bins[i].append(d)
                if check is not None:
                    check.put(i, bins[i])
                heapq.heappush(heap, (load + c, i, tok + x))
                for item in aside:
                    heapq.heappush(heap, item)
            for b in bins:
                if b:
                    mbs.append((b, 0))
    return mbs


def fit_memory(cm: CostModel, tt: TypeTable, s: np.ndarray, mbs: list[tuple[list[int], int]]) -> tuple[list[tuple[list[int], int]], float]:
    """Raise recompute on the largest micro-batches of the fullest 1F1B window until the
    replica's peak fits (micro-batches in their final order)."""
    if not mbs:
        return mbs, cm.state_bytes(tt.layout)
    lay = tt.layout
    free = cm.capacity_bytes - cm.state_bytes(lay)
    levels = tt.allowed_rs
    pos_of = {rs: i for i, rs in enumerate(levels)}
    tokens = np.array([float(s[d].sum()) if len(d) > 1 else float(s[d[0]]) for d, _ in mbs])
    # bytes of every micro-batch at every level [micro-batch, level]: kept, transient, alone
    if tt.quadratic:
        K, TR, LA = level_bytes(cm, lay, levels, s, mbs)
    else:
        per = tt.act_per_token(cm)  # [level, (keep, trans, logits)] per token
        K, TR = tokens[:, None] * per[None, :, 0], tokens[:, None] * per[None, :, 1]
        LA = K + TR + tokens[:, None] * per[None, :, 2]
    lvl = np.array([pos_of.get(rs, 0) for _, rs in mbs])
    m, w = len(mbs), min(tt.pp, len(mbs))
    rows = np.arange(m)
    top = len(levels) - 1
    for _ in range(m * len(levels) + 1):
        keep, trans, last = K[rows, lvl], TR[rows, lvl], LA[rows, lvl]
        over_last = last - free
        if w > 1:
            cs = np.concatenate([[0.0], np.cumsum(keep)])
            win = cs[w:] - cs[:-w]
            tmax = np.lib.stride_tricks.sliding_window_view(trans, w).max(axis=1)
            over_win = win + tmax - free
        else:
            over_win = np.array([-1.0])
        worst_last = int(np.argmax(over_last))
        worst_win = int(np.argmax(over_win))
        if over_last[worst_last] <= 0 and over_win[worst_win] <= 0:
            peak = free - min(-over_last.max(), -over_win.max())
            return [(d, levels[int(l)]) for (d, _), l in zip(mbs, lvl)], cm.state_bytes(lay) + peak
        if over_last[worst_last] > over_win[worst_win]:
            cand = [worst_last] if lvl[worst_last] < top else []
        else:
            span = range(worst_win, worst_win + w)
            cand = sorted((i for i in span if lvl[i] < top), key=lambda i: -keep[i])[:1]
        if not cand:
            raise PlanningError(
                f"micro-batches of {int(tokens.max())} tokens do not fit {lay} even with full recompute "
                f"(capacity {cm.capacity_bytes / 1e9:.1f} GB)"
            )
        lvl[cand[0]] += 1
    raise PlanningError(f"could not fit the micro-batches of a {lay} replica in memory")  # pragma: no cover


def _price_single_stage(cm: CostModel, tt: TypeTable, s, mbs) -> float | None:
    """finish_replica's pricing of a pp == 1 replica by the C++ kernel (csrc/planner.cpp,
    equal to the Python below bit for bit): the sum of its micro-batches' times, or None
    where a micro-batch exceeds its cap (the Python path then fits memory first), the
    kernel is not built, or the lengths are not integers (Python's float sums differ)."""
    price = kernel("price_single_stage")
    if price is None or not isinstance(s, (list, np.ndarray)):
        return None
    caps = tt.caps_by_level()
    try:
        ok, pipe = price(s, mbs if isinstance(mbs, list) else list(mbs), cm.coeff_table(tt.layout, len(caps)), caps,
                         ATTN_BWD_FACTOR)
    except (IndexError, TypeError):  # float lengths, or a level beyond the stage's layers: the Python path
        return None
    return pipe if ok else None


def finish_replica(cm: CostModel, tt: TypeTable, ranks: list[int], s: np.ndarray, mbs, num_replicas: int) -> PackedReplica:
    """Order, fit in memory (raising recompute where a 1F1B window overflows), and price
    one replica's micro-batches exactly (1F1B simulation + sync)."""
    lay = tt.layout
    if tt.pp == 1 and not tt.quadratic:
        fast = _price_single_stage(cm, tt, s, mbs)
        if fast is not None:  # every micro-batch within its cap: priced by the kernel
            sync = cm.sync_time(lay, num_replicas)
            return PackedReplica(lay, ranks, mbs, fast + sync, fast, sync, 0.0)
    sl = s.tolist() if isinstance(s, np.ndarray) else list(s)
    stats = []
    for docs, rs in mbs:
        if len(docs) == 1:
            x = sl[docs[0]]
            stats.append((float(x * x), float(x), 1))
        else:
            v = [sl[d] for d in docs]
            stats.append((float(sum(x * x for x in v)), float(sum(v)), len(v)))
    if tt.pp == 1:
        # packing kept every micro-batch within the cap of its recompute level
        if tt.quadratic:
            ok = fits_alone(cm, lay, sl, mbs)
        else:
            ok = all(t <= tt.caps_alone[tt.allowed_rs.index(rs)] * (1 + 1e-12) if rs in tt.allowed_rs else False
                     for (_, rs), (_, t, _) in zip(mbs, stats))
        if not ok:
            mbs, _ = fit_memory(cm, tt, np.asarray(s), mbs)
        pipe = 0.0
        for (docs, rs), (s2, t, n) in zip(mbs, stats):
            pipe += cm.coeffs(lay, rs).mb_time(s2, t, n)
        peak = 0.0
    else:
        cost = [cm.coeffs(lay, rs).mb_time(*st) for (_, rs), st in zip(mbs, stats)]
        order = sorted(range(len(mbs)), key=cost.__getitem__, reverse=True)
        mbs = [mbs[i] for i in order]
        stats = [stats[i] for i in order]
        mbs, peak = fit_memory(cm, tt, np.asarray(s), mbs)
        fwd, bwd = [], []
        for (docs, rs), st in zip(mbs, stats):
            f, b = cm.coeffs(lay, rs).mb_fwd_bwd(*st)
            fwd.append(f)
            bwd.append(b)
        pipe = one_f_one_b(fwd, bwd, tt.pp).makespan
    sync = cm.sync_time(lay, num_replicas)
    return PackedReplica(lay, ranks, mbs, pipe + sync, pipe, sync, peak)


def pack_and_price(cm: CostModel, tables: dict, prep, placement, docs: list[list[int]]) -> list[PackedReplica]:
    """Stage 2 of a full plan: every replica of `placement` (layout, ranks) packed
    (pack_replica) and priced (finish_replica) from stage 1's `docs` (sorted positions per
    replica; `prep`: the batch's BatchPrep). Replicas with memory linear in tokens are
    packed by the C++ kernel in one call (csrc/planner.cpp, equal to pack_replica), which
    also prices the single-stage ones (equal to finish_replica); the rest, and any replica
    the kernel hands back, run these two functions here."""
    R = len(placement)
    fast = _pack_by_kernel(cm, tables, prep, placement, docs)
    out = []
    for k, (lay, ranks) in enumerate(placement):
        got = fast[k] if fast is not None else None
        if got is not None:
            pipe, mbs = got
            if lay.pp == 1:
                sync = prep.sync(lay, R)
                out.append(PackedReplica(lay, ranks, mbs, pipe + sync, pipe, sync, 0.0))
            else:
                out.append(finish_replica(cm, tables[lay], ranks, prep.s_list, mbs, R))
            continue
        orig = [prep.order_list[p] for p in docs[k]]
        mbs = pack_replica(cm, tables[lay], prep.s_list, orig, stage_cost=prep.cost_by_position(lay))
        out.append(finish_replica(cm, tables[lay], ranks, prep.s_list, mbs, R))
    return out


def _pack_by_kernel(cm: CostModel, tables: dict, prep, placement, docs) -> list | None:
    """The kernel pack_replicas on the placement's replicas with memory linear in tokens:
    per replica None (the Python path runs it) or (pipeline seconds, NaN on pipelines,
    micro-batches); None where the kernel is not built (or DCP_KERNELS=python)."""
    run = kernel("pack_replicas")
    if run is None or not placement:
        return None
    index: dict[Layout, int] = {}
    for lay, _ in placement:
        tt = tables[lay]
        if lay not in index and not tt.quadratic and not cm.quadratic(lay):
            index[lay] = len(index)
    if not index:
        return None
    tts = [tables[lay] for lay in index]
    L = max(len(tt.allowed_rs) for tt in tts)
    C = max(tt.layers_per_stage + 1 for tt in tts)
    levels = np.zeros((len(tts), L), dtype=np.int64)
    doc_caps = np.full((len(tts), L), np.inf)
    coef = np.zeros((len(tts), C, 8))
    caps = np.full((len(tts), C), -np.inf)
    for t, tt in enumerate(tts):
        n, c = len(tt.allowed_rs), tt.layers_per_stage + 1
        levels[t, :n] = tt.allowed_rs
        doc_caps[t, :n] = tt.doc_caps
        coef[t, :c] = cm.coeff_table(tt.layout, c)
        caps[t, :c] = tt.caps_by_level()
    cost = np.stack([prep.types[lay].cost for lay in index]) if prep.n else np.zeros((len(tts), 0))
    type_of = np.array([index.get(lay, -1) for lay, _ in placement], dtype=np.int64)
    return run(prep.s, prep.order, docs, type_of, np.array([tt.cap_mb for tt in tts], dtype=float),
               np.array([tt.pp for tt in tts], dtype=np.int64), levels, doc_caps,
               np.array([len(tt.allowed_rs) for tt in tts], dtype=np.int64), coef, caps, cost, ATTN_BWD_FACTOR)


def to_iteration_plan(index: int, sample_ids: Sequence[int], reps: Sequence[PackedReplica], cm: CostModel) -> IterationPlan:
    ids = sample_ids.tolist() if isinstance(sample_ids, np.ndarray) else [int(x) for x in sample_ids]
    out = []
    for r in reps:
        layers = {rs: cm.recompute_layers(r.layout, rs) for rs in {rs for _, rs in r.micro_batches}}
        strategies = r.layer_strategies or [None] * len(r.micro_batches)
        out.append(
            ReplicaPlan(
                ranks=list(r.ranks),
                tp=r.layout.tp,
                cp=r.layout.cp,
                pp=r.layout.pp,
                micro_batches=[
                    MicroBatchPlan([ids[d] for d in docs], layers[rs], st)
                    for (docs, rs), st in zip(r.micro_batches, strategies, strict=True)
                ],
                predicted_time_s=float(r.time_s),
                stage_layers=list(r.stage_layers) if r.stage_layers else None,
            )
        )
    return IterationPlan(
        index=index,
        sample_ids=ids,
        replicas=out,
        predicted_time_s=float(max((r.time_s for r in reps), default=0.0)) + cm.iteration_overhead_s,
    )

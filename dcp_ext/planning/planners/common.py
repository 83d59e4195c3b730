"""Pieces every planner shares: per-layout tables, placement, packing, replica timing.

Why a module of its own: the adaptive planner and the baselines differ in *where* they put
documents and which layouts they allow, never in how a replica's micro-batches are priced
or how memory is checked. Keeping that here makes the comparison fair by construction.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from dcp_ext.assign.backend import kernel
from dcp_ext.planning.cost_model import ATTN_BWD_FACTOR, CostModel
from dcp_ext.planning.layout import Layout, LayoutMix
from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
from dcp_ext.planning.planners.doc_memory import BinCheck, bin_check, doc_caps, fits_alone, level_bytes
from dcp_ext.planning.simulator import one_f_one_b


class PlanningError(ValueError):
    """A batch (or a sequence in it) that no allowed layout can run."""


# ---------------------------------------------------------------------------- layout tables
@dataclass
class TypeTable:
    """What a planner needs to know about one replica layout, computed once."""

    layout: Layout
    size: int
    pp: int
    layers_per_stage: int
    allowed_rs: list[int]  # recompute levels (layers per stage) the planner may use
    caps_alone: list[float]  # max tokens of a lone micro-batch per allowed rs (monotone)
    cap_mb: float  # max tokens of a micro-batch without recompute, 1F1B window included
    sync_lb: float  # receive-side sync (lower bound)
    caps_window: list[float] = field(default_factory=list)  # per allowed_rs, pp equal ones in flight
    mb_full: float = math.inf  # stage seconds of a micro-batch of cap_mb tokens (no recompute)
    # layouts whose memory is quadratic in document lengths (CPU attention): the longest
    # document per allowed rs, alone and (pipelines) with pp like it in flight; exact, where
    # the token caps above are only upper bounds
    doc_caps_alone: list[int] | None = None
    doc_caps_window: list[int] | None = None
    _act: np.ndarray | None = field(default=None, repr=False, compare=False)
    _caps_by_level: np.ndarray | None = field(default=None, repr=False, compare=False)

    def caps_by_level(self) -> np.ndarray:
        """caps_alone per recompute level 0..layers_per_stage, -inf where a level is not
        allowed (the C++ pricing's cap check; cached)."""
        if self._caps_by_level is None:
            caps = np.full(self.layers_per_stage + 1, -np.inf)
            for rs, cap in zip(self.allowed_rs, self.caps_alone):
                if 0 <= rs <= self.layers_per_stage:
                    caps[rs] = cap
            self._caps_by_level = caps
        return self._caps_by_level

    def act_per_token(self, cm: CostModel) -> np.ndarray:
        """[allowed rs, (kept, transient, last-stage extra)] activation bytes per token (cached)."""
        if self._act is None:
            self._act = np.array([cm.act_bytes_per_token(self.layout, rs) for rs in self.allowed_rs])
        return self._act

    @property
    def plan_caps(self) -> list[float]:
        """Caps a planner packs against: alone for pp == 1; for pipelines, such that pp
        micro-batches of that size fit in flight, so any 1F1B window of them fits."""
        return self.caps_window if self.pp > 1 else self.caps_alone

    @property
    def quadratic(self) -> bool:
        return self.doc_caps_alone is not None

    @property
    def doc_caps(self) -> list[float]:
        """Longest document a planner gives each allowed rs: the plan caps, or on quadratic
        layouts the exact per-document ones (alone; pipelines: pp like it in flight)."""
        if self.doc_caps_alone is None:
            return self.plan_caps
        return self.doc_caps_window if self.pp > 1 else self.doc_caps_alone

    @property
    def max_doc(self) -> float:
        caps = self.doc_caps
        return caps[-1] if caps else 0.0

    def rs_for(self, tokens: float) -> int | None:
        """Fewest recomputed layers per stage that hold `tokens` alone (quadratic layouts:
        one document of that length)."""
        caps = self.caps_alone if self.doc_caps_alone is None else self.doc_caps_alone
        i = bisect.bisect_left(caps, tokens)
        return self.allowed_rs[i] if i < len(self.allowed_rs) else None

    def rs_planned(self, tokens: float) -> int | None:
        """Recompute a planner gives a document of `tokens` alone (see doc_caps)."""
        i = bisect.bisect_left(self.doc_caps, tokens)
        return self.allowed_rs[i] if i < len(self.allowed_rs) else None


def make_type_table(cm: CostModel, layout: Layout, recompute: str = "any") -> TypeTable:
    """recompute: 'any' (0..layers per stage), 'off' (none), 'full' (none or all)."""
    layout = Layout(*layout)
    Ls = cm.layers_per_stage(layout)
    levels = {"any": list(range(Ls + 1)), "off": [0], "full": [0, Ls] if Ls > 0 else [0]}[recompute]
    caps, rs_ok = [], []
    best = -1.0
    for rs in levels:
        c = cm.max_tokens(layout, rs, 1)
        if c > best:  # keep only levels that hold more than the cheaper ones
            caps.append(c)
            rs_ok.append(rs)
            best = c
    cap_mb = cm.max_tokens(layout, 0, layout.pp) if layout.pp > 1 else cm.max_tokens(layout, 0, 1)
    win = list(np.maximum.accumulate([cm.max_tokens(layout, rs, layout.pp) for rs in rs_ok])) if layout.pp > 1 else []
    co = cm.coeffs(layout, 0)
    mb_full = co.c0 + co.b * cap_mb + co.c if cap_mb > 0 else math.inf
    docs = {}
    if cm.quadratic(layout):
        docs = dict(doc_caps_alone=doc_caps(cm, layout, rs_ok, 1),
                    doc_caps_window=doc_caps(cm, layout, rs_ok, layout.pp) if layout.pp > 1 else [])
    return TypeTable(layout, layout.size, layout.pp, Ls, rs_ok, caps, cap_mb, cm.sync_time(layout, None), win, mb_full,
                     **docs)


@dataclass
class DocCosts:
    """Per-document planning numbers of one batch on one layout (docs in the batch's order)."""

    cost: np.ndarray  # per-stage seconds a document adds (recompute it needs, CP excess, amortised c0)
    alone: np.ndarray  # pp * stage time of the document alone (no sync)
    rs: np.ndarray  # recompute level it needs alone (-1: does not fit)


def _level_groups(idx: np.ndarray):
    """(level, selection) for every level present in `idx`: slices where idx runs in
    order (a batch sorted longest first: each level is one run), else boolean masks."""
    if len(idx) == 0:
        return
    steps = np.diff(idx)
    if (steps <= 0).all() or (steps >= 0).all():
        change = np.flatnonzero(steps) + 1
        starts = np.concatenate([[0], change]).tolist()
        ends = np.concatenate([change, [len(idx)]]).tolist()
        for a, b in zip(starts, ends):
            yield int(idx[a]), slice(a, b)
        return
    for k in np.unique(idx):
        yield int(k), idx == k


def doc_costs(cm: CostModel, tt: TypeTable, s: np.ndarray) -> DocCosts:
    n = len(s)
    cost = np.full(n, np.inf)
    alone = np.full(n, np.inf)
    rs_arr = np.full(n, -1, dtype=np.int64)
    idx = np.searchsorted(np.asarray(tt.doc_caps), s, side="left")
    sf = s.astype(float)
    for k, sel in _level_groups(idx):
        if k >= len(tt.allowed_rs):
            continue
        rs = tt.allowed_rs[int(k)]
        co = cm.coeffs(tt.layout, rs)
        ss = sf[sel]
        s2 = ss * ss
        base = co.a * s2 + co.b * ss + co.c
        ex = co.excess(s2, ss) if co.cp_comm else 0.0
        t_alone = co.c0 + base + ex
        cost[sel] = base + ex
        alone[sel] = tt.pp * t_alone
        rs_arr[sel] = rs
    # micro-batch constant, amortised over the tokens of a full micro-batch (memory caps the
    # micro-batch, so at least tokens/cap_mb of them); pipelines add their bubble per replica
    if tt.cap_mb > 0:
        c0 = cm.coeffs(tt.layout, 0).c0
        cost = cost + c0 * np.minimum(sf / tt.cap_mb, 1.0)
    return DocCosts(cost, alone, rs_arr)


def pipeline_overhead(work: float, pp: int, c0: float, mb_full: float = math.inf) -> float:
    """Bubble plus extra micro-batch constants of a pp-stage 1F1B replica doing `work`
    seconds of stage work (documents' costs, which already carry one constant per full
    micro-batch): with m equal micro-batches it is (pp-1)*work/m + extra*c0, at best
    2*sqrt((pp-1)*c0*work); when memory already forces micro-batches of at most a full
    one (`mb_full` seconds) it is at most (pp-1)*mb_full."""
    if pp == 1 or work <= 0:
        return 0.0
    q = pp - 1
    return min(2.0 * math.sqrt(q * c0 * work), q * mb_full)


def pipeline_capacity(work_room: float, pp: int, c0: float, mb_full: float = math.inf) -> float:
    """Largest stage work W with W + pipeline_overhead(W) <= work_room."""
    if work_room <= 0:
        return 0.0
    if pp == 1:
        return work_room
    k = (pp - 1) * c0
    w_sqrt = (math.sqrt(k + work_room) - math.sqrt(k)) ** 2
    return max(w_sqrt, work_room - (pp - 1) * mb_full)


# ---------------------------------------------------------------------------- placement
def place(layouts: Sequence[Layout], world: int) -> list[tuple[Layout, list[int]]]:
    """Contiguous, size-aligned rank blocks (largest replicas first), Megatron order inside
    each block (tp fastest, then cp, then pp). Deterministic."""
    order = sorted((Layout(*l) for l in layouts), key=lambda l: (-l.size, -l.tp, -l.cp, -l.pp))
    out, start = [], 0
    for lay in order:
        out.append((lay, list(range(start, start + lay.size))))
        start += lay.size
    if start != world:
        raise ValueError(f"layouts use {start} devices, the world has {world}")
    return out


def canonical(counts: dict[Layout, int]) -> LayoutMix:
    return tuple(sorted(((Layout(*k), v) for k, v in counts.items() if v > 0), key=lambda kv: (-kv[0].size, -kv[0].tp, -kv[0].cp, -kv[0].pp)))


def parse_layout(spec) -> LayoutMix:
    """"4xtp1cp1pp1", "1xtp2cp1pp1+2xtp1cp1pp1" or a list of (tp, cp, pp) replicas."""
    import re

    counts: dict[Layout, int] = {}
    if isinstance(spec, str):
        for part in spec.split("+"):
            m = re.fullmatch(r"\s*(?:(\d+)\s*x\s*)?tp(\d+)cp(\d+)pp(\d+)\s*", part)
            if not m:
                raise ValueError(f"layout {spec!r}: expected parts like 2xtp2cp1pp1")
            n = int(m.group(1) or 1)
            lay = Layout(int(m.group(2)), int(m.group(3)), int(m.group(4)))
            counts[lay] = counts.get(lay, 0) + n
    else:
        for t in spec:
            lay = Layout(*[int(v) for v in t])
            counts[lay] = counts.get(lay, 0) + 1
    return canonical(counts)


def expand(counts: Iterable[tuple[Layout, int]]) -> list[Layout]:
    return [lay for lay, n in counts for _ in range(n)]


def describe(counts: Iterable[tuple[Layout, int]]) -> str:
    return "+".join(f"{n}x{lay}" for lay, n in counts)


def mix_label(counts: Iterable[tuple[Layout, int]]) -> str:
    """`cp2 + 2×tp1`: a mix as the log line names an iteration's layout."""
    def one(lay: Layout) -> str:
        return "·".join(f"{k}{v}" for k, v in (("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp)) if v > 1) or "tp1"

    return " + ".join(f"{n}×{one(lay)}" if n > 1 else one(lay) for lay, n in counts)


# ---------------------------------------------------------------------------- packing
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
    micro-batches); None where the kernel is not built (or DCP_ASSIGN_IMPL=python)."""
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


def sample_batches(length_sample: Sequence[int], global_batch_tokens: int, max_seq_len: int, count: int, seed: int) -> list[np.ndarray]:
    """Global batches drawn from the dataset's length histogram: the sample shuffled with
    `seed`, cut by the global batch rule; `count` of them, evenly spaced. These are not the
    batches the run will see, only batches like them."""
    from dcp_ext.planning.batching import iter_global_batches

    lens = np.minimum(np.asarray(length_sample, dtype=np.int64), max_seq_len)
    if len(lens) == 0:
        raise ValueError("empty length sample")
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    rounds = 0
    while len(out) < count and rounds < 8:
        perm = lens[rng.permutation(len(lens))]
        batches = [perm[b] for b in iter_global_batches(perm, global_batch_tokens, max_seq_len)]
        if batches and batches[-1].sum() < 0.5 * global_batch_tokens and len(batches) > 1:
            batches = batches[:-1]  # a short tail batch is not typical
        out.extend(batches)
        rounds += 1
    if len(out) > count:
        pick = np.linspace(0, len(out) - 1, count).round().astype(int)
        out = [out[i] for i in pick]
    return out


def extreme_batches(length_sample: Sequence[int], global_batch_tokens: int, max_seq_len: int, seed: int) -> list[np.ndarray]:
    """Batches of the histogram's short half only, its long tail only, and a typical batch
    with its few longest documents: rarer batches the candidate pool should also serve."""
    lens = np.minimum(np.asarray(length_sample, dtype=np.int64), max_seq_len)
    rng = np.random.default_rng(seed + 1)
    out = []
    for lo_q, hi_q in ((0.0, 0.5), (0.9, 1.0)):
        lo, hi = np.quantile(lens, lo_q), np.quantile(lens, hi_q)
        pool = lens[(lens >= lo) & (lens <= hi)]
        if len(pool) == 0:
            continue
        pick = pool[rng.integers(0, len(pool), size=4 * len(lens) + 16)]
        cs = np.cumsum(pick)
        k = max(1, int(np.searchsorted(cs, global_batch_tokens, side="right")))
        out.append(pick[:k])
    return out

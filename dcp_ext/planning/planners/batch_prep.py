"""One batch as the adaptive planner sees it: documents sorted, per-layout cost tables, and
the water-filling estimate that ranks layout mixes on it.

Why a module of its own: both the pool built once per run (`planners.candidates`) and
every iteration's planning (`planners.adaptive`, `planners.rebalance`) work on these
tables; they are computed once per batch and shared. `TypeOnBatch.finish` is the one
estimate of a replica's finish time (sync + work + pipeline overhead) they all use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout, LayoutMix
from dcp_ext.planning.planners.tables import DocCosts, TypeTable, doc_costs, pipeline_capacity, pipeline_overhead


@dataclass
class TypeOnBatch:
    tt: TypeTable
    cost: np.ndarray  # sorted order (longest first)
    alone: np.ndarray
    rs: np.ndarray
    cum: np.ndarray  # len n+1 prefix sums (0 for documents it cannot hold)
    first_ok: int  # first sorted position the layout can hold
    c0: float

    def overhead(self, work, big=0.0):
        """What a pipeline adds to a replica's stage work: the larger of `pipeline_overhead`
        (bubble and extra micro-batch constants) and (pp-1) times its largest document's
        cost `big`; 0 for pp == 1. Floats, or numpy arrays of work and big: the two branches
        do the same operations in the same order."""
        pp = self.tt.pp
        if pp == 1:
            return 0.0
        q = pp - 1
        if not isinstance(work, np.ndarray) and not isinstance(big, np.ndarray):
            return max(pipeline_overhead(work, pp, self.c0, self.tt.mb_full), q * big)
        with np.errstate(invalid="ignore"):
            over = np.minimum(2.0 * np.sqrt(q * self.c0 * np.maximum(work, 0.0)), q * self.tt.mb_full)
        return np.maximum(over, q * big)

    def finish(self, sync, work, big=0.0):
        """Estimated finish of a replica of this type: sync + stage work + `overhead`."""
        if self.tt.pp == 1:
            return sync + work
        return sync + work + self.overhead(work, big)


class BatchPrep:
    """One batch's documents sorted longest first, with per-layout cost tables."""

    def __init__(self, cm: CostModel, tables: dict[Layout, TypeTable], lengths: Sequence[int]):
        self.cm = cm
        self.s = np.asarray(lengths, dtype=np.int64)
        self.order = np.argsort(-self.s, kind="stable")
        self.ss = self.s[self.order]
        self.n = len(self.s)
        self.types: dict[Layout, TypeOnBatch] = {}
        self.tables = tables
        self._sync: dict[tuple[Layout, int], float] = {}
        self._cost_by_position: dict[Layout, list[float]] = {}
        for lay, tt in tables.items():
            self.add(lay, tt)

    @cached_property
    def s_list(self) -> list[int]:
        """The lengths in the batch's order, as a list (packing indexes it per document)."""
        return self.s.tolist()

    @cached_property
    def order_list(self) -> list[int]:
        """Batch position of each sorted position, as a list."""
        return self.order.tolist()

    def cost_by_position(self, lay: Layout) -> list[float]:
        """The layout's per-document costs in the batch's order (not sorted), as a list."""
        got = self._cost_by_position.get(lay)
        if got is None:
            arr = np.empty(self.n)
            arr[self.order] = self.types[lay].cost
            got = self._cost_by_position[lay] = arr.tolist()
        return got

    def add(self, lay: Layout, tt: TypeTable) -> TypeOnBatch:
        got = self.types.get(lay)
        if got is not None:
            return got
        dc: DocCosts = doc_costs(self.cm, tt, self.ss)
        fin = np.isfinite(dc.cost)
        first_ok = int(np.argmax(fin)) if fin.any() else self.n
        if fin.any() and not fin[first_ok:].all():  # pragma: no cover - sorted: misfits are a prefix
            first_ok = self.n
        # documents a layout cannot hold are a prefix (longest first) that no range may
        # start in; count them as 0 so the sums stay exact for the rest
        c = np.where(fin, dc.cost, 0.0)
        cum = np.concatenate([[0.0], np.cumsum(c)])
        tob = TypeOnBatch(tt, dc.cost, dc.alone, dc.rs, cum, first_ok, self.cm.coeffs(lay, 0).c0)
        self.types[lay] = tob
        return tob

    def sync(self, lay: Layout, num_replicas: int | None) -> float:
        key = (lay, num_replicas or 0)
        v = self._sync.get(key)
        if v is None:
            v = self.cm.sync_time(lay, num_replicas)
            self._sync[key] = v
        return v


# ---------------------------------------------------------------------------- screening
def type_order(prep: BatchPrep, layouts: Sequence[Layout]) -> list[Layout]:
    def key(l: Layout):
        t = prep.types[l]
        a0 = t.alone[0] if prep.n and t.first_ok == 0 else math.inf
        return (a0, -l.size, -l.tp, -l.cp, -l.pp)

    return sorted(layouts, key=key)


def _fill(prep: BatchPrep, order: Sequence[tuple[Layout, int, float]], T: float) -> tuple[bool, list[int]]:
    """Water-filling at iteration time T: each type (in order) takes the longest remaining
    documents up to its capacity. Returns (all placed, boundaries per type)."""
    pos, n = 0, prep.n
    bounds = []
    for lay, cnt, sync in order:
        t = prep.types[lay]
        if pos >= n:
            bounds.append(pos)
            continue
        room = T - sync
        if room <= 0 or pos < t.first_ok or t.alone[pos] + sync > T:
            bounds.append(pos)
            continue
        wp = pipeline_capacity(room, lay.pp, t.c0, t.tt.mb_full)
        if lay.pp > 1:
            # the replica holding a document pays ~(pp-1) times its cost in bubble
            big = t.cost[pos : pos + cnt]
            w = float(np.minimum(wp, room - (lay.pp - 1) * big).clip(min=0).sum()) + wp * max(0, cnt - len(big))
        else:
            w = wp * cnt
        end = int(np.searchsorted(t.cum, t.cum[pos] + w, side="right")) - 1
        pos = max(pos, min(end, n))
        bounds.append(pos)
    return pos >= n, bounds


def screen(prep: BatchPrep, counts: LayoutMix, rel_tol: float = 2e-3, lo: float = 0.0) -> tuple[float, list[tuple[Layout, int, float]], list[int]]:
    """Estimated iteration time of `counts` on this batch (inf if it cannot run it), the
    type order used and the document boundaries per type at that time."""
    R = sum(c for _, c in counts)
    lays = type_order(prep, [l for l, _ in counts])
    cnt = dict(counts)
    order = [(l, cnt[l], prep.sync(l, R)) for l in lays]
    if prep.n == 0:
        return max((s for _, _, s in order), default=0.0), order, [0] * len(order)
    # the longest document must be held by someone
    lo = max(lo, min((prep.types[l].alone[0] + s for l, _, s in order if prep.types[l].first_ok == 0), default=math.inf))
    if not math.isfinite(lo):
        return math.inf, order, []
    ok, b = _fill(prep, order, lo)
    if ok:
        return lo, order, b
    hi = lo * 1.5 + 1e-9
    for _ in range(40):
        ok, b = _fill(prep, order, hi)
        if ok:
            break
        lo, hi = hi, hi * 2
    else:
        return math.inf, order, []
    for _ in range(40):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if _fill(prep, order, mid)[0]:
            hi = mid
        else:
            lo = mid
    ok, b = _fill(prep, order, hi)
    return hi, order, b

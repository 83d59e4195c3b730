"""Per-layout price tables: what a planner knows about one replica layout, computed once,
and each document's cost on it (with the pipeline's bubble as a function of work).

Why a module of its own: the adaptive planner and the baselines differ in where they put
documents and which layouts they allow, never in how a layout prices a document; every
planner reads these tables, so the comparison between them is fair by construction.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.planners.doc_memory import doc_caps


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

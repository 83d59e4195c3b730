"""Time of a micro-batch whose layers run under different (tp, cp) strategies, or on uneven stages.

Why it exists: the plan contract v2 lets a micro-batch run each layer under its own
re-factoring (tp', cp') of its replica's tp*cp ranks (ParaDySe) and a replica split its
layers unevenly over its pipeline stages (OmniBal). The planner that chooses them and the
simulator that judges them must price them alike, and a plan that uses neither must cost
exactly what `cost_model` says. This module is that price list, built from the cost
model's own pieces:

  * one layer under (a, b) costs what one layer of layout (a, b, pp) costs
    (`CostModel.analytic_terms`; calibrated coefficients are split the way the analytic
    ones are, field by field, so the layers and fixed parts of a layout add up to its
    calibrated price at rs 0);
  * a recomputed layer's backward adds that layer's forward (megatron-core's block
    recompute: the first layers of each stage, as many as the plan's recompute_layers
    give the stage, ceil(R * layers_in_stage / num_layers), as the runtime's executor);
  * a stage's fixed part runs in the replica's own ("home") strategy: the micro-batch
    constant and pipeline p2p, the output layer and loss on the last stage, the embedding
    on the first. Without a stage split every stage pays the output layer (the v1 price,
    identical stages); with one each stage pays its own;
  * every boundary where consecutive layers, or the home strategy and a stage's
    first/last layer, differ re-lays the hidden states out with one all-to-all over the
    stage's tp*cp ranks: tokens_local * hidden * bytes * (n-1)/n per rank, forward and
    again backward.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import ATTN_BWD_FACTOR, MATMUL_BWD_FACTOR, CostModel, StageCoeffs
from dcp_ext.planning.layout import Layout

Strategy = tuple[int, int]  # (tp, cp) of one layer
_FIELDS = ("a_f", "b_f", "c_f", "c0_f", "a_b", "b_b", "c_b", "c0_b")


def stage_recompute(recompute_layers: int, layers_in_stage: int, num_layers: int) -> int:
    """Recomputed layers of a stage of `layers_in_stage` (the first ones): the executor's share."""
    return min(layers_in_stage, -(-recompute_layers * layers_in_stage // max(num_layers, 1)))


def stage_bounds(num_layers: int, pp: int, split: Sequence[int] | None) -> list[tuple[int, int]]:
    counts = list(split) if split else [num_layers // pp] * pp
    out, first = [], 0
    for n in counts:
        out.append((first, first + n))
        first += n
    return out


def refactorings(cm: CostModel, tp: int, cp: int) -> list[Strategy]:
    """Every (tp', cp') with tp' * cp' = tp * cp that the model and a node allow (home included)."""
    n = tp * cp
    out = []
    for a in range(1, n + 1):
        if n % a == 0 and cm.model.valid_tp(a) and a <= cm.cluster.gpus_per_node:
            out.append((a, n // a))
    return out


class LayerPrices:
    """Per-layer, per-stage and re-layout prices of one cost model (cached per strategy)."""

    def __init__(self, cm: CostModel):
        self.cm = cm
        self._layer: dict[tuple[Strategy, int], StageCoeffs] = {}
        self._fixed: dict[tuple[Strategy, int, str], StageCoeffs] = {}
        self._ratio: dict[Layout, dict[str, float]] = {}
        self._group: dict[tuple[Strategy, int, int, int], StageCoeffs] = {}

    def clear(self) -> None:
        """Prices changed (recalibration)."""
        self._layer.clear()
        self._fixed.clear()
        self._ratio.clear()
        self._group.clear()

    # ------------------------------------------------------------------ coefficients
    def _ratios(self, lay: Layout) -> dict[str, float]:
        """Calibrated / analytic, per coefficient, of the layout at rs 0 (1.0 when analytic)."""
        got = self._ratio.get(lay)
        if got is None:
            cal = self.cm.coeffs(lay, 0)
            ana = self.cm.analytic_coeffs(lay, 0)
            got = {}
            for f in _FIELDS:
                a, c = getattr(ana, f), getattr(cal, f)
                got[f] = c / a if a != 0.0 else 1.0
            got["cp_att"], got["cp_comm"] = cal.cp_att, cal.cp_comm
            self._ratio[lay] = got
        return got

    def layer(self, strategy: Strategy, pp: int) -> StageCoeffs:
        """One layer (not recomputed) under `strategy` in a pp-stage replica."""
        key = (tuple(strategy), int(pp))
        got = self._layer.get(key)
        if got is None:
            lay = Layout(strategy[0], strategy[1], pp)
            t = self.cm.analytic_terms(lay)
            r = self._ratios(lay)
            lin, tpc = t["lin_pt"], t["tpc_pt"]
            fixed = t["lin_fixed"] + t["tpc_fixed"] + t["cp_fixed"]
            fixed_b = MATMUL_BWD_FACTOR * t["lin_fixed"] + t["tpc_fixed"] + t["cp_fixed"]
            got = StageCoeffs(
                a_f=t["att_s2"] * r["a_f"], b_f=(lin + tpc) * r["b_f"], c_f=t["doc"] * r["c_f"], c0_f=fixed * r["c0_f"],
                a_b=ATTN_BWD_FACTOR * t["att_s2"] * r["a_b"], b_b=(MATMUL_BWD_FACTOR * lin + tpc) * r["b_b"],
                c_b=MATMUL_BWD_FACTOR * t["doc"] * r["c_b"], c0_b=fixed_b * r["c0_b"],
                cp_att=r["cp_att"], cp_comm=r["cp_comm"], cp_layers=1.0, cp_recompute=0.0,
            )
            self._layer[key] = got
        return got

    def layers(self, strategy: Strategy, pp: int, n: int, recomputed: int) -> StageCoeffs:
        """`n` layers under `strategy`, `recomputed` of them recomputed (each adds its forward)."""
        key = (tuple(strategy), int(pp), int(n), int(recomputed))
        got = self._group.get(key)
        if got is None:
            L = self.layer(strategy, pp)
            r = recomputed
            got = StageCoeffs(
                a_f=n * L.a_f, b_f=n * L.b_f, c_f=n * L.c_f, c0_f=n * L.c0_f,
                a_b=n * L.a_b + r * L.a_f, b_b=n * L.b_b + r * L.b_f, c_b=n * L.c_b + r * L.c_f,
                c0_b=n * L.c0_b + r * L.c0_f,
                cp_att=L.cp_att, cp_comm=L.cp_comm, cp_layers=float(n), cp_recompute=float(r),
            )
            self._group[key] = got
        return got

    def fixed(self, home: Strategy, pp: int, where: str) -> StageCoeffs:
        """A stage's own part, in the home strategy. where: "same" (the v1 price: every stage
        alike, each paying the output layer), or for a stage split "first", "middle",
        "last" ("only" when pp == 1)."""
        key = (tuple(home), int(pp), where)
        got = self._fixed.get(key)
        if got is None:
            lay = Layout(home[0], home[1], pp)
            t = self.cm.analytic_terms(lay)
            r = self._ratios(lay)
            logits = where in ("same", "last", "only")
            emb = where in ("first", "only")
            b_f = t["p2p_pt"] + (t["log_pt"] if logits else 0.0)
            b_b = t["p2p_pt"] + (MATMUL_BWD_FACTOR * t["log_pt"] if logits else 0.0)
            c0_f = t["overhead"] + t["p2p_fixed"] + (t["log_fixed"] if logits else 0.0)
            c0_b = t["p2p_fixed"] + (MATMUL_BWD_FACTOR * t["log_fixed"] if logits else 0.0)
            if emb:
                ef, eb, e0 = self._embedding(lay)
                b_f, b_b, c0_f, c0_b = b_f + ef, b_b + eb, c0_f + e0, c0_b + e0
            got = StageCoeffs(a_f=0.0, b_f=b_f * r["b_f"], c_f=0.0, c0_f=c0_f * r["c0_f"],
                              a_b=0.0, b_b=b_b * r["b_b"], c_b=0.0, c0_b=c0_b * r["c0_b"])
            self._fixed[key] = got
        return got

    def _embedding(self, lay: Layout) -> tuple[float, float, float]:
        """(forward, backward per token, per micro-batch) of the vocabulary-parallel
        embedding: the row lookup (its gradient's fp32 scatter-add in the backward) and its
        TP reduction (a reduce-scatter with sequence parallelism, else an all-reduce)."""
        m, cl, g = self.cm.model, self.cm.cluster, self.cm.cluster.gpu
        h, e = m.hidden_size, m.activation_bytes
        look_f = h * e / lay.cp / g.hbm_bandwidth
        look_b = 2.0 * h * m.grad_bytes / lay.cp / g.hbm_bandwidth
        if lay.tp > 1:
            bw, lat = cl.link(lay.tp)
            k = 1.0 if m.sequence_parallel else 2.0
            comm = k * h * e * (lay.tp - 1) / lay.tp / lay.cp / bw
            fixed = (lay.tp - 1) * lat
        else:
            comm = fixed = 0.0
        return look_f + comm, look_b + comm, fixed

    # ------------------------------------------------------------------ re-layout
    def tokens_per_rank_div(self, s: Strategy) -> int:
        """Ranks a strategy's hidden states are split over (T / that per rank): cp, and tp
        too with sequence parallelism (without it TP ranks hold the CP-local sequence)."""
        tp, cp = s
        return cp * tp if (tp == 1 or self.cm.model.sequence_parallel) else cp

    def relayout_coeffs(self, src: Strategy, dst: Strategy) -> tuple[float, float]:
        """(seconds per token of the micro-batch, seconds per re-layout) of one all-to-all
        from src to dst over the stage's tp*cp ranks, one direction (the backward pays it again)."""
        if tuple(src) == tuple(dst):
            return 0.0, 0.0
        n = src[0] * src[1]
        if n == 1:
            return 0.0, 0.0
        m, cl = self.cm.model, self.cm.cluster
        bw, lat = cl.link(n)
        div = min(self.tokens_per_rank_div(src), self.tokens_per_rank_div(dst))
        return m.hidden_size * m.activation_bytes * (n - 1) / n / div / bw, (n - 1) * lat

    def relayout_s(self, src: Strategy, dst: Strategy, tokens: float) -> float:
        pt, fixed = self.relayout_coeffs(src, dst)
        return pt * tokens + fixed if (pt or fixed) else 0.0

    # ------------------------------------------------------------------ vectorised per layer
    def layer_times(self, strategy: Strategy, pp: int, s2, tokens, n_docs) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) of one layer under `strategy` for arrays of micro-batches
        (sum s^2, tokens, documents). A recomputed layer's backward adds its forward."""
        L = self.layer(strategy, pp)
        s2, tokens, n_docs = (np.asarray(v, dtype=float) for v in (s2, tokens, n_docs))
        f = L.c0_f + L.a_f * s2 + L.b_f * tokens + L.c_f * n_docs
        b = L.c0_b + L.a_b * s2 + L.b_b * tokens + L.c_b * n_docs
        if L.cp_comm:
            att, com = L.cp_att * s2, L.cp_comm * tokens
            f = f + np.maximum(0.0, com - att)
            b = b + np.maximum(0.0, 2.0 * com - ATTN_BWD_FACTOR * att)
        return f, b


# ---------------------------------------------------------------------------- one micro-batch
def stage_layout(num_layers: int, first: int, end: int, strategies, home: Strategy, rs: int):
    """(Counter of (strategy, recomputed) -> layers, list of (src, dst) re-layouts) of the
    stage's layers [first, end) of one micro-batch, its first `rs` layers recomputed."""
    key = tuple(strategies) if strategies else None
    return _stage_layout(first, end, key, tuple(home), int(rs))


@lru_cache(maxsize=65536)
def _stage_layout(first: int, end: int, strategies, home: Strategy, rs: int):
    segments = []  # (lo, hi exclusive, strategy) covering [first, end) in order
    at = first
    for st in strategies or ():
        lo, hi = max(st.first, first), min(st.last + 1, end)
        if lo >= hi:
            continue
        if lo > at:
            segments.append((at, lo, home))
        segments.append((lo, hi, (st.tp, st.cp)))
        at = hi
    if at < end:
        segments.append((at, end, home))
    groups: Counter = Counter()
    moves = []
    prev = home
    cut = first + rs
    for lo, hi, s in segments:
        rec = max(0, min(hi, cut) - lo)
        if rec:
            groups[(s, True)] += rec
        if hi - lo - rec:
            groups[(s, False)] += hi - lo - rec
        if s != prev:
            moves.append((prev, s))
        prev = s
    if prev != home:
        moves.append((prev, home))
    return groups, moves


def where_of(p: int, pp: int, split) -> str:
    if not split:
        return "same"
    if pp == 1:
        return "only"
    return "first" if p == 0 else ("last" if p == pp - 1 else "middle")


def fwd_bwd_arrays(co: StageCoeffs, s2, tokens, n_docs) -> tuple[np.ndarray, np.ndarray]:
    """`StageCoeffs.mb_fwd_bwd` for arrays of micro-batches (the same operations)."""
    s2, tokens, n_docs = (np.asarray(v, dtype=float) for v in (s2, tokens, n_docs))
    f = co.c0_f + co.a_f * s2 + co.b_f * tokens + co.c_f * n_docs
    b = co.c0_b + co.a_b * s2 + co.b_b * tokens + co.c_b * n_docs
    if co.cp_comm != 0.0:
        att, com = co.cp_att * s2, co.cp_comm * tokens
        ex_f = np.maximum(0.0, com - att)
        ex_b = np.maximum(0.0, 2.0 * com - ATTN_BWD_FACTOR * att)
        f = f + co.cp_layers * ex_f
        b = b + co.cp_layers * ex_b + co.cp_recompute * ex_f
    return f, b


def stage_parts(lp: LayerPrices, layout: Layout, split, recompute_layers: int, strategies):
    """Per stage: (the StageCoeffs that add up to it, re-layout (per token, per micro-batch))
    for micro-batches of this recompute and these layer strategies. Without either (v1)
    every stage is the cost model's stage."""
    cm = lp.cm
    layout = Layout(*layout)
    if not split and not strategies:
        co = cm.coeffs(layout, cm.stage_recompute(layout, recompute_layers))
        return [([co], (0.0, 0.0))] * layout.pp
    home = (layout.tp, layout.cp)
    L = cm.model.num_layers
    out = []
    for p, (first, end) in enumerate(stage_bounds(L, layout.pp, split)):
        rs = stage_recompute(recompute_layers, end - first, L)
        groups, moves = stage_layout(L, first, end, strategies, home, rs)
        parts = [lp.fixed(home, layout.pp, where_of(p, layout.pp, split))]
        by_strategy: dict = {}
        for (s, rec), count in groups.items():
            tot, r = by_strategy.get(s, (0, 0))
            by_strategy[s] = (tot + count, r + (count if rec else 0))
        parts += [lp.layers(s, layout.pp, count, r) for s, (count, r) in by_strategy.items()]
        pt = fixed = 0.0
        for src, dst in moves:
            a, c = lp.relayout_coeffs(src, dst)
            pt, fixed = pt + a, fixed + c
        out.append((parts, (pt, fixed)))
    return out


def stage_times_arrays(lp: LayerPrices, layout: Layout, split, s2, tokens, n_docs, recompute_layers: int,
                       strategies) -> tuple[np.ndarray, np.ndarray]:
    """fwd[stage, i], bwd[stage, i] of micro-batches i that share a recompute and layer strategies."""
    tokens = np.asarray(tokens, dtype=float)
    parts = stage_parts(lp, layout, split, recompute_layers, strategies)
    F = np.zeros((len(parts), len(tokens)))
    B = np.zeros((len(parts), len(tokens)))
    for p, (cos, (pt, fixed)) in enumerate(parts):
        for co in cos:
            f, b = fwd_bwd_arrays(co, s2, tokens, n_docs)
            F[p] += f
            B[p] += b
        if pt or fixed:
            F[p] += pt * tokens + fixed
            B[p] += pt * tokens + fixed
    return F, B


def micro_batch_stage_times(lp: LayerPrices, layout: Layout, split, stats: tuple[float, float, int],
                            recompute_layers: int, strategies) -> tuple[list[float], list[float]]:
    """Per stage (forward, backward) seconds of one micro-batch (sum s^2, tokens, documents)
    on a replica of `layout` with stage split `split` (None: even) and these layer strategies.
    Without either (v1) every stage is the cost model's stage time."""
    s2, tokens, n = stats
    F, B = stage_times_arrays(lp, layout, split, [s2], [tokens], [n], recompute_layers, strategies)
    return F[:, 0].tolist(), B[:, 0].tolist()


def layer_local_params(cm: CostModel, tp: int) -> float:
    """Parameters of one layer on one rank at tensor parallelism tp (norms replicated)."""
    h = cm.model.hidden_size
    return (cm.model.layer_params - 2 * h) / tp + 2 * h

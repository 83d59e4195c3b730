"""Time and memory of one micro-batch under a replica layout (tp, cp, pp, recompute).

Why it exists: every planner, the baselines, the simulator and the lower bound must price
the same work the same way, or comparisons between them mean nothing. This module is that
single price list. It is analytic by default (FLOPs, bytes, bandwidths from the specs),
calibrated from a profile file (`dcp_ext.planning.profile`) when one is given, and
recalibrated while training from the run's own timings (`dcp_ext.planning.calibration`,
whose corrections apply on top of that prior).

Shape of the model. For one pipeline stage and one micro-batch holding documents s_i
(T = sum s_i tokens, x = T / cp rows per device):

    stage time = c0 + a * sum(s_i^2) + b * T + c * n_docs + cp_excess(sum s_i^2, T)

  * b: GEMMs (3x forward work with the backward, +1x per recomputed layer), TP collectives
    (all-gather/reduce-scatter with sequence parallel, all-reduce without: same bytes),
    the output layer on the last stage, pipeline point-to-point;
  * a: causal, document-masked attention (sum of s^2, never pack length^2), 2.5x forward
    for the backward;
  * c: per document work that does not shrink with tp or cp (a per-document attention
    loop on the CPU; zero for GPUs by default);
  * c0: per micro-batch fixed cost: framework overhead, collective latencies and the GEMM
    efficiency lost on few rows (modelled as `half_efficiency_tokens` extra rows per GEMM:
    throughput x / (x + x_half), i.e. a constant per micro-batch);
  * cp_excess >= 0: context-parallel key/value exchange (ring of 2*cp balanced chunks)
    overlaps attention; only the part of it that attention cannot hide costs time.

Everything except cp_excess is additive over documents, so a document's cost without the
micro-batch constant and without cp_excess is a true lower bound of what it adds to any
micro-batch: the simulator's lower bound relies on exactly that.

Memory (bytes per device) is the other half of the price list: `dcp_ext.planning.cost_memory`,
whose methods CostModel inherits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_memory import MemoryAccounting
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

ATTN_BWD_FACTOR = 2.5  # flash-attention backward / forward FLOPs
MATMUL_BWD_FACTOR = 2.0


@dataclass(frozen=True)
class StageCoeffs:
    """Per-stage, per-micro-batch time coefficients of one (layout, rs), split fwd/bwd.

    time_fwd = c0_f + a_f*S2 + b_f*T + c_f*n ; time_bwd likewise; plus cp excess
    (ex_* terms, attention vs key/value exchange, evaluated per micro-batch).
    """

    a_f: float
    b_f: float
    c_f: float
    c0_f: float
    a_b: float
    b_b: float
    c_b: float
    c0_b: float
    # cp overlap: per-layer attention forward per unit S2, kv exchange per token (bandwidth
    # part), layers per stage and recomputed layers per stage
    cp_att: float = 0.0
    cp_comm: float = 0.0
    cp_layers: float = 0.0
    cp_recompute: float = 0.0

    @property
    def a(self) -> float:
        return self.a_f + self.a_b

    @property
    def b(self) -> float:
        return self.b_f + self.b_b

    @property
    def c(self) -> float:
        return self.c_f + self.c_b

    @property
    def c0(self) -> float:
        return self.c0_f + self.c0_b

    def excess(self, s2, tokens):
        """Non-hidden kv exchange time (>= 0), fwd + bwd, for arrays or scalars."""
        if self.cp_comm == 0.0:
            return np.zeros(np.shape(s2)) if isinstance(s2, np.ndarray) else 0.0
        att = self.cp_att * np.asarray(s2, dtype=float)
        com = self.cp_comm * np.asarray(tokens, dtype=float)
        ex_f = np.maximum(0.0, com - att)
        ex_b = np.maximum(0.0, 2.0 * com - ATTN_BWD_FACTOR * att)
        out = (self.cp_layers + self.cp_recompute) * ex_f + self.cp_layers * ex_b
        return out if isinstance(s2, np.ndarray) else float(out)

    def excess_split(self, s2: float, tokens: float) -> tuple[float, float]:
        if self.cp_comm == 0.0:
            return 0.0, 0.0
        att, com = self.cp_att * s2, self.cp_comm * tokens
        ex_f = max(0.0, com - att)
        ex_b = max(0.0, 2.0 * com - ATTN_BWD_FACTOR * att)
        # recomputed layers run their forward (and its exchange) inside the backward
        return self.cp_layers * ex_f, self.cp_layers * ex_b + self.cp_recompute * ex_f

    def doc_cost(self, lengths) -> np.ndarray | float:
        """Additive per-document part (no c0, no cp excess): a lower bound of its cost."""
        s = np.asarray(lengths, dtype=float)
        return self.a * s * s + self.b * s + self.c

    def mb_time(self, s2, tokens, n_docs) -> np.ndarray | float:
        return self.c0 + self.a * s2 + self.b * tokens + self.c * n_docs + self.excess(s2, tokens)

    def mb_fwd_bwd(self, s2: float, tokens: float, n_docs: int) -> tuple[float, float]:
        ef, eb = self.excess_split(s2, tokens)
        f = self.c0_f + self.a_f * s2 + self.b_f * tokens + self.c_f * n_docs + ef
        b = self.c0_b + self.a_b * s2 + self.b_b * tokens + self.c_b * n_docs + eb
        return f, b


class CostModel(MemoryAccounting):
    """The price list for (model, cluster); optionally calibrated by a `Profile`."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, profile=None, memory_margin: float = 0.1):
        self.model = model
        self.cluster = cluster
        self.profile = profile
        self.memory_margin = memory_margin
        self._coeffs: dict[tuple[Layout, int], StageCoeffs] = {}
        self._coeff_tables: dict[tuple[Layout, int], np.ndarray] = {}  # coeff_table's
        self.layer_price_cache = None  # simulator.layer_prices' LayerPrices, cleared on recalibration
        self._prior: dict[tuple[Layout, int], StageCoeffs] = {}
        self._prior_sync: dict[tuple, float] = {}  # prior_sync_time per (layout, num_replicas, profile)
        self.calibration = None  # a dcp_ext.planning.calibration.Calibration, set by the training loop
        self.buffer_params = 0.0  # see charge_shared_buffers
        self.buffer_by_layout: dict = {}
        self.communicators = 0  # per rank, the most over ranks: see charge_communicators
        # uneven pipeline stages: Layout -> layers per stage (dcp_ext.planning.planners.stage_split);
        # empty: every layout splits its layers evenly
        self.stage_splits: dict[Layout, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ layouts
    def layout_valid(self, layout: Layout) -> bool:
        tp, cp, pp = layout
        m, c = self.model, self.cluster
        return (
            min(tp, cp, pp) >= 1
            and m.valid_tp(tp)
            and m.valid_pp(pp)
            and tp <= c.gpus_per_node
            and layout.size <= c.num_gpus
        )

    def layers_per_stage(self, layout: Layout) -> int:
        return self.model.num_layers // layout.pp

    def recompute_layers(self, layout: Layout, rs: int) -> int:
        """Model-wide recompute_layers (the plan's field) for rs recomputed layers per stage."""
        return rs * layout.pp

    def stage_recompute(self, layout: Layout, recompute_layers: int) -> int:
        return min(self.layers_per_stage(layout), math.ceil(recompute_layers / layout.pp))

    # ------------------------------------------------------------------ FLOPs
    @property
    def layer_matmul_flops_per_token(self) -> float:
        m = self.model
        h, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_size
        return 2.0 * h * (h + 2 * kv) + 2.0 * h * h + 2.0 * h * f * (3 if m.swiglu else 2)

    @property
    def logits_flops_per_token(self) -> float:
        return 2.0 * self.model.hidden_size * self.model.vocab_size

    # ------------------------------------------------------------------ time
    def prior_coeffs(self, layout: Layout, rs: int = 0) -> StageCoeffs:
        """Before recalibration: analytic, or the profile's when one is given."""
        key = (Layout(*layout), int(rs))
        got = self._prior.get(key)
        if got is None:
            got = self.analytic_coeffs(*key)
            if self.profile is not None:
                got = self.profile.calibrate(self, key[0], key[1], got)
            self._prior[key] = got
        return got

    def coeffs(self, layout: Layout, rs: int = 0) -> StageCoeffs:
        key = (Layout(*layout), int(rs))
        got = self._coeffs.get(key)
        if got is None:
            got = self.prior_coeffs(*key)
            if self.calibration is not None and self.calibration.observed:
                got = self.calibration.adjust(key[0], key[1], got)
            self._coeffs[key] = got
        return got

    def coeff_table(self, layout: Layout, levels: int) -> np.ndarray:
        """[levels, 8]: (c0, a, b, c, cp_att, cp_comm, cp_layers, cp_recompute) of
        coeffs(layout, rs) for rs < levels, the C++ pricing's input (cached like coeffs)."""
        key = (Layout(*layout), int(levels))
        got = self._coeff_tables.get(key)
        if got is None:
            rows = []
            for rs in range(levels):
                k = self.coeffs(layout, rs)
                rows.append((k.c0, k.a, k.b, k.c, k.cp_att, k.cp_comm, k.cp_layers, k.cp_recompute))
            got = self._coeff_tables[key] = np.array(rows, dtype=np.float64).reshape(levels, 8)
        return got

    def recalibrated(self) -> None:
        """The calibration changed: prices are recomputed from it on next use."""
        self._coeffs.clear()
        self._coeff_tables.clear()
        if self.layer_price_cache is not None:
            self.layer_price_cache.clear()

    @property
    def iteration_overhead_s(self) -> float:
        """What an iteration spends outside its replicas (measured; 0 before any measurement)."""
        cal = self.calibration
        return cal.outside_s if cal is not None and cal.observed else 0.0

    def analytic_terms(self, layout: Layout) -> dict[str, float]:
        """The analytic price's pieces for one layout, per layer and per stage (seconds per
        token, per unit of sum s^2, or per micro-batch): what `analytic_coeffs` assembles
        into a stage's coefficients and `dcp_ext.planning.layer_cost` into one layer's."""
        m, cl, g = self.model, self.cluster, self.cluster.gpu
        tp, cp, pp = layout
        e = m.activation_bytes
        p_mm = g.peak_flops * g.matmul_efficiency
        p_at = g.peak_flops * g.attention_efficiency
        xh = g.half_efficiency_tokens
        Fl = self.layer_matmul_flops_per_token

        # per layer, forward, per token of the micro-batch (x = T/cp rows per device)
        lin_pt = Fl / (tp * cp) / p_mm
        lin_fixed = xh * Fl / tp / p_mm
        att_s2 = 2.0 * m.hidden_size / (tp * cp) / p_at
        if tp > 1:
            bw, lat = cl.link(tp)
            tpc_pt = 4.0 * m.hidden_size * e * (tp - 1) / tp / cp / bw
            tpc_fixed = 4.0 * (tp - 1) * lat
        else:
            tpc_pt = tpc_fixed = 0.0
        if cp > 1:
            bw, lat = cl.link(tp * cp)
            cp_comm = (cp - 1) / cp * 2.0 * m.kv_size * e / tp / bw
            cp_fixed = (cp - 1) * lat
        else:
            cp_comm = cp_fixed = 0.0
        # output layer (last stage) and pipeline p2p (both directions)
        log_pt = self.logits_flops_per_token / (tp * cp) / p_mm
        log_fixed = xh * self.logits_flops_per_token / tp / p_mm
        if pp > 1:
            bw, lat = cl.link(layout.size)
            sp_div = tp if (m.sequence_parallel or tp == 1) else 1
            p2p_pt = m.hidden_size * e / sp_div / cp / bw
            p2p_fixed = lat
        else:
            p2p_pt = p2p_fixed = 0.0
        return dict(lin_pt=lin_pt, lin_fixed=lin_fixed, att_s2=att_s2, tpc_pt=tpc_pt, tpc_fixed=tpc_fixed,
                    cp_comm=cp_comm, cp_fixed=cp_fixed, log_pt=log_pt, log_fixed=log_fixed, p2p_pt=p2p_pt,
                    p2p_fixed=p2p_fixed, overhead=g.micro_batch_overhead_s, doc=g.attention_doc_overhead_s)

    def analytic_coeffs(self, layout: Layout, rs: int) -> StageCoeffs:
        tp, cp, pp = layout
        Ls = self.layers_per_stage(layout)
        rs = min(rs, Ls)
        t = self.analytic_terms(layout)
        g = self.cluster.gpu
        lin_pt, lin_fixed, att_s2 = t["lin_pt"], t["lin_fixed"], t["att_s2"]
        tpc_pt, tpc_fixed, cp_comm, cp_fixed = t["tpc_pt"], t["tpc_fixed"], t["cp_comm"], t["cp_fixed"]
        log_pt, log_fixed, p2p_pt, p2p_fixed = t["log_pt"], t["log_fixed"], t["p2p_pt"], t["p2p_fixed"]

        fwd_layers = Ls
        bwd_layers = Ls
        a_f = fwd_layers * att_s2
        a_b = bwd_layers * ATTN_BWD_FACTOR * att_s2 + rs * att_s2
        b_f = fwd_layers * (lin_pt + tpc_pt) + log_pt + p2p_pt
        b_b = bwd_layers * (MATMUL_BWD_FACTOR * lin_pt + tpc_pt) + rs * (lin_pt + tpc_pt) + MATMUL_BWD_FACTOR * log_pt + p2p_pt
        c0_f = g.micro_batch_overhead_s + fwd_layers * (lin_fixed + tpc_fixed + cp_fixed) + log_fixed + p2p_fixed
        c0_b = (
            bwd_layers * (MATMUL_BWD_FACTOR * lin_fixed + tpc_fixed + cp_fixed)
            + rs * (lin_fixed + tpc_fixed + cp_fixed)
            + MATMUL_BWD_FACTOR * log_fixed
            + p2p_fixed
        )
        doc = g.attention_doc_overhead_s
        c_f = fwd_layers * doc
        c_b = bwd_layers * MATMUL_BWD_FACTOR * doc + rs * doc
        return StageCoeffs(
            a_f=a_f, b_f=b_f, c_f=c_f, c0_f=c0_f, a_b=a_b, b_b=b_b, c_b=c_b, c0_b=c0_b,
            cp_att=att_s2, cp_comm=cp_comm, cp_layers=float(Ls), cp_recompute=float(rs),
        )

    def mb_stage_time(self, lengths: Sequence[int], layout: Layout, rs: int = 0) -> float:
        s = np.asarray(lengths, dtype=float)
        return float(self.coeffs(layout, rs).mb_time(float(np.dot(s, s)), float(s.sum()), len(s)))

    def mb_fwd_bwd(self, lengths: Sequence[int], layout: Layout, rs: int = 0) -> tuple[float, float]:
        s = np.asarray(lengths, dtype=float)
        return self.coeffs(layout, rs).mb_fwd_bwd(float(np.dot(s, s)), float(s.sum()), len(s))

    def mb_replica_time(self, lengths: Sequence[int], layout: Layout, rs: int = 0) -> float:
        """Forward+backward of one micro-batch alone on the replica (pp stages in sequence):
        what a profile record measures."""
        return layout.pp * self.mb_stage_time(lengths, layout, rs)

    # ------------------------------------------------------------------ optimizer sync
    def prior_sync_time(self, layout: Layout, num_replicas: int | None = None) -> float:
        """Per-iteration pull (params into the layout) + push (grads into the fixed
        sharding over all ranks) for one device of `layout`. Each device receives its
        stage's parameter slice; each device also sends its 1/N fixed shard to every
        replica (num_replicas), so the slower of the two directions counts. With
        num_replicas=None only the receive side is counted (a lower bound). Kept per
        (layout, num_replicas, profile): the planner asks for it every replica of every plan."""
        key = (Layout(*layout), num_replicas, id(self.profile))
        got = self._prior_sync.get(key)
        if got is None:
            got = self._prior_sync[key] = self._prior_sync_time(Layout(*layout), num_replicas)
        return got

    def _prior_sync_time(self, layout: Layout, num_replicas: int | None) -> float:
        m, cl = self.model, self.cluster
        n = cl.num_gpus
        if n == 1:
            return 0.0
        recv_params = m.stage_params(layout.pp) / layout.tp
        send_params = (num_replicas or 0) * m.num_params / n
        vol = max(recv_params, send_params)
        if n > cl.gpus_per_node:
            f_inter = (n - cl.gpus_per_node) / n
            bw_i, lat_i = cl.gpu.inter_node_bw, cl.gpu.inter_node_latency
        else:
            f_inter, bw_i, lat_i = 0.0, 1.0, 0.0
        bw_l, lat_l = cl.gpu.intra_node_bw, cl.gpu.intra_node_latency

        def phase(bytes_per_param: int) -> float:
            v = vol * bytes_per_param
            return max(v * f_inter / bw_i, v * (1 - f_inter) / bw_l) + 2 * (lat_i + lat_l) * math.log2(max(n, 2))

        t = phase(m.param_bytes) + phase(m.grad_reduce_bytes)
        if self.profile is not None:
            t = self.profile.calibrate_sync(self, layout, t)
        return t

    def sync_time(self, layout: Layout, num_replicas: int | None = None) -> float:
        t = self.prior_sync_time(layout, num_replicas)
        cal = self.calibration
        return t * cal.sync_ratio(Layout(*layout)) if cal is not None and cal.observed else t

    # ------------------------------------------------------------------ layouts the cluster allows
    def all_layouts(self, power_of_two: bool = True) -> list[Layout]:
        """Every valid (tp, cp, pp) whose replica size divides the world and whose model
        state fits on a device; sizes are powers of two so blocks stay aligned."""
        n = self.cluster.num_gpus
        out = []
        pows = [1 << i for i in range(0, 20) if (1 << i) <= n]
        for tp in pows:
            for cp in pows:
                for pp in pows:
                    lay = Layout(tp, cp, pp)
                    if lay.size > n or n % lay.size or not self.layout_valid(lay):
                        continue
                    if self.capacity_bytes - self.state_bytes(lay) <= 0:
                        continue
                    out.append(lay)
        return out


def next_pow2(x: float) -> int:
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))

"""Time and memory of one micro-batch under a replica layout (tp, cp, pp, recompute).

Why it exists: every planner, the baselines, the simulator and the lower bound must price
the same work the same way, or comparisons between them mean nothing. This module is that
single price list. It is analytic by default (FLOPs, bytes, bandwidths from the specs) and
calibrated from a profile file (`dcp_ext.planning.profile`) when one is given.

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

Memory (bytes per device): parameter and gradient shards of the layout, the optimizer's
fixed shard over all ranks, activations per token per layer with and without recompute,
the micro-batches 1F1B keeps in flight (stage 0 holds a window of pp), and the transient
output-layer logits. Recompute is counted in layers per stage (`rs`); the plan's
`recompute_layers` is the model-wide count, rs * pp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from dcp_ext.planning.layout import Layout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec, bucket_numel_for

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


class CostModel:
    """The price list for (model, cluster); optionally calibrated by a `Profile`."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, profile=None, memory_margin: float = 0.1):
        self.model = model
        self.cluster = cluster
        self.profile = profile
        self.memory_margin = memory_margin
        self._coeffs: dict[tuple[Layout, int], StageCoeffs] = {}
        self.buffer_params = 0.0  # see charge_shared_buffers
        self.buffer_by_layout: dict = {}

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
    def coeffs(self, layout: Layout, rs: int = 0) -> StageCoeffs:
        key = (Layout(*layout), int(rs))
        got = self._coeffs.get(key)
        if got is None:
            got = self._analytic_coeffs(*key)
            if self.profile is not None:
                got = self.profile.calibrate(self, key[0], key[1], got)
            self._coeffs[key] = got
        return got

    def _analytic_coeffs(self, layout: Layout, rs: int) -> StageCoeffs:
        m, cl, g = self.model, self.cluster, self.cluster.gpu
        tp, cp, pp = layout
        Ls = self.layers_per_stage(layout)
        rs = min(rs, Ls)
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
    def sync_time(self, layout: Layout, num_replicas: int | None = None) -> float:
        """Per-iteration pull (params into the layout) + push (grads into the fixed
        sharding over all ranks) for one device of `layout`. Each device receives its
        stage's parameter slice; each device also sends its 1/N fixed shard to every
        replica (num_replicas), so the slower of the two directions counts. With
        num_replicas=None only the receive side is counted (a lower bound)."""
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

    # ------------------------------------------------------------------ memory
    @property
    def capacity_bytes(self) -> float:
        g = self.cluster.gpu
        return g.memory_bytes * (1.0 - self.memory_margin) - g.reserved_bytes

    def state_bytes(self, layout: Layout) -> float:
        """Persistent bytes on one device, as the runtime allocates them: the rank's shared
        parameter and fp32 main-grad buffers (sized to the largest stage it can play: this
        layout's, or the pool's when `charge_shared_buffers` was called), its shard of the
        optimizer state (fp32 master, fp32 gradient, Adam moments) and the exchange buffers."""
        m = self.model
        buffer = self.buffer_params_for(layout)
        opt = m.num_params * m.optimizer_bytes_per_param / self.cluster.num_gpus
        return buffer * (m.param_bytes + m.grad_bytes) + opt + self.exchange_bytes

    def buffer_params_for(self, layout: Layout) -> float:
        """Parameters in the shared buffers of a device that runs `layout`."""
        shared = self.buffer_by_layout.get(Layout(*layout), self.buffer_params)
        return max(self.model.local_stage_params(layout.tp, layout.pp), shared)

    @property
    def exchange_bytes(self) -> float:
        """Send and receive buffers of one bucket (two of each when pull/push overlap)."""
        m, n = self.model, self.cluster.num_gpus
        per = n * math.ceil(bucket_numel_for(m.num_params, m.bucket_numel) / n)
        return 2 * m.exchange_slots * per * max(m.param_bytes, m.grad_reduce_bytes)

    def charge_shared_buffers(self, layouts: Iterable[Layout], placements=None) -> None:
        """The layouts of a pool share each rank's buffers. Without `placements`, charge every
        layout the pool's largest stage; with them ((layout, ranks) of every replica the pool
        can run), charge each layout the largest stage any of its ranks plays."""
        stage = lambda l: self.model.local_stage_params(l.tp, l.pp)  # noqa: E731
        layouts = list(layouts)
        self.buffer_params = max((stage(l) for l in layouts), default=0.0)
        self.buffer_by_layout = {}
        if placements is not None:
            per_rank: dict[int, float] = {}
            for lay, ranks in placements:
                for r in ranks:
                    per_rank[r] = max(per_rank.get(r, 0.0), stage(lay))
            for lay, ranks in placements:
                worst = max(per_rank[r] for r in ranks)
                self.buffer_by_layout[Layout(*lay)] = max(self.buffer_by_layout.get(Layout(*lay), 0.0), worst)

    @lru_cache(maxsize=None)
    def _act_terms(self, layout: Layout) -> dict:
        """Activation bytes per row of a micro-batch on one device (rows = T/cp tokens), from
        what autograd saves in megatron-core's layers (see the comment on each term).

        Measured exactly on the CPU by `benchmarks/bench_activation_memory.py` (TP1, TP2 with
        sequence parallel, CP2, PP2; with and without full recompute; packed and single
        documents): within a few percent. The GPU terms that differ (TE attention, TE norms,
        fused SwiGLU and RoPE) follow TE's and megatron-core's code, not a measurement.

        Notation: e activation bytes, h hidden, f ffn, kv key/value width, d head dim,
        t = tp, sp = t when the sequence is split over TP (sequence parallel), else 1."""
        m = self.model
        t, cp = layout.tp, layout.cp
        e = m.activation_bytes
        h, f, kv, d, heads = m.hidden_size, m.ffn_hidden_size, m.kv_size, m.head_dim, m.num_attention_heads
        sp = t if (t == 1 or m.sequence_parallel) else 1
        # The CPU backend (no transformer-engine): dcp_ext.runtime.model.layer_spec puts megatron-core's
        # local spec together with dcp_ext.runtime.attention's core attention and torch norms, and runs
        # what transformer_config_from_args configures: no bias-activation fusion, no RoPE
        # fusion. The GPU terms assume upstream Megatron's GPU settings instead: TE layers,
        # fused bias-SwiGLU (--bias-swiglu-fusion) and fused RoPE.
        # transformer_config_from_args (megatron/training/model_flags.py) turns the fusions on
        # on CUDA as upstream does; a GPU run with --no-bias-swiglu-fusion / --no-rope-fusion
        # keeps the CPU's unfused `mlp` (+2f/t) and `rope` (+4d) terms below as well.
        cpu = self.cluster.gpu.name.startswith("cpu")
        unfused = cpu

        # ---- every layer, both backends
        # the layer input and the mid-layer residual (outputs of the residual adds): saved as
        # the inputs of the two norms (TE: of the two LayerNormLinear GEMMs)
        resid = 2.0 * h * e / sp
        # the two norm outputs, saved by linear_qkv and linear_fc1 as their inputs (with
        # sequence parallel the local shard: the all-gather is redone in the backward)
        norm_out = 2.0 * h * e / sp
        # RoPE, unfused (megatron-core's _apply_rotary_pos_emb_bshd): cos and sin [rows, 1, 1,
        # d] saved by the two products, once for q and once for k; every row of the (gathered)
        # sequence, shared by the heads, so not divided by tp. Fused RoPE keeps none per row.
        rope = 4.0 * d * e if unfused else 0.0
        # MLP. Unfused gated unit (megatron-core's MLP.glu): fc1's output (2f, saved through
        # the x_glu view by silu), silu(x_glu) and x_linear + glu_linear_offset (a copy; both
        # saved by their product), the product (fc2's input): 5f. Fused bias-SwiGLU keeps
        # fc1's output and the product: 3f. GELU: fc1's output and gelu's: 2f.
        if m.swiglu:
            mlp = (5.0 if unfused else 3.0) * f * e / t
        else:
            mlp = 2.0 * f * e / t
        # dropout masks (1 byte) after attention and after the MLP
        drop = 2.0 * h / sp if m.hidden_dropout else 0.0
        if cpu:
            # dcp_ext.runtime.attention: SDPA on 3-D [heads, s, d] tensors runs torch's math path (not
            # the CPU flash kernel). It keeps q*scale (h/t), the GQA-expanded k*scale and v of
            # the whole document (h/t each per key row: a CP rank all-gathers keys and values,
            # so cp key rows per local query row) and the concatenated output (linear_proj's
            # input, h/t); plus the softmax probabilities, heads/t values per (query, key) pair
            # of a document: quadratic in the document lengths (`pair`, act_bytes_per_token).
            # Without GQA and CP, v is never copied: its view keeps linear_qkv's whole output
            # (h + 2kv) instead. Nothing else of q, k, v survives the forward.
            v = (h + 2.0 * kv) if (kv == h and cp == 1) else h * cp
            attn = (h + h * cp + v + h) * e / t
            # torch.nn.RMSNorm decomposes into aten ops that also keep the normalized input
            # (before the weight product) and rsqrt, per norm (LayerNorm's single aten op keeps
            # mean/rstd only: this over-counts h/sp per norm for it)
            norm_extra = 2.0 * (h + 1.0) * e / sp
        else:
            # TE attention (flash / cuDNN, THD): q, k, v, the output (also linear_proj's
            # input) and fp32 softmax statistics, linear in the length; TE fuses the norms into
            # the GEMMs (input and normalized output kept, counted above)
            attn = ((h + 2 * kv) + h) * e / t + heads / t * 4.0
            norm_extra = 0.0
        full = resid + norm_out + rope + mlp + attn + norm_extra + drop
        # full recompute ("block", one checkpoint per layer): the layer input only
        ckpt = h * e / sp
        # the stage's last output: the final norm's input on the last stage, the tensor sent to
        # the next stage (held for its backward) on the others
        emb = h * e / sp
        # with sequence parallel the all-gathered linear input [rows, h] (every TP rank holds
        # the whole sequence): megatron-core's global memory buffer, alive from the first
        # linear on (TE gathers into buffers of its own, of the same size)
        ws = h * e if (t > 1 and sp > 1) else 0.0
        # a layer's backward on top of what it keeps peaks in its MLP: the incoming gradient
        # (h/sp) and the two gradients of the gated product (f each; fc2's saved input is freed
        # by then), or gelu's input gradient and fc1's output gradient. (On the CPU, long
        # documents move the peak into the attention: see act_bytes_per_token.)
        work = 2.0 * f * e / t + h * e / sp
        # last stage: the final norm's output (the output layer's input) and, on the CPU, the
        # norm's normalized copy and rsqrt; the fused native cross entropy converts the logits
        # to fp32 and keeps exp/softmax in that buffer (4 bytes per vocabulary entry); its
        # int64/bool target masks (9 bytes per row) are left out
        last_keep = h * e / sp + ((h + 1.0) * e / sp if cpu else 0.0) + m.vocab_size / t * 4.0
        # its backward: the logits gradient rounded to bf16 (megatron-core 0.16 does so in any
        # dtype), then autograd's cast back to the logits' dtype when that is not bf16
        logits_trans = m.vocab_size / t * (2.0 + (e if e != 2 else 0.0))
        # CPU math-path attention: bytes per (query, key) pair of a document and layer
        pair = heads / t * e if cpu else 0.0
        return dict(full=full, ckpt=ckpt, emb=emb, work=work, ws=ws, mlp=mlp, last_keep=last_keep,
                    logits_trans=logits_trans, pair=pair)

    def act_bytes_per_token(self, layout: Layout, rs: int, lengths: Sequence[int] | None = None
                            ) -> tuple[float, float, float]:
        """(kept while in flight, transient on a middle stage, transient extra on the last
        stage) bytes per token of the micro-batch (already divided by cp), so that a stage's
        peak is tokens * (kept + transient) and the last stage's tokens * (kept + transient +
        extra).

        The backward of the last stage peaks either at the loss's backward (final norm and
        softmax still kept, logits gradients, the SP buffer) or inside a layer's backward (the
        recomputed layer, the layer workspace): the extra is what the former adds beyond the
        latter. `lengths`: the micro-batch's (padded) document lengths, for the terms that are
        quadratic in them (CPU attention's probabilities; none on GPUs); without them those
        terms are left out."""
        a = self._act_terms(Layout(*layout))
        Ls = self.layers_per_stage(layout)
        rs = min(rs, Ls)
        cp = layout.cp
        keep = ((Ls - rs) * a["full"] + rs * a["ckpt"] + a["emb"]) / cp
        # the recomputed layer (one at a time, re-materialized in the backward) and the SP buffer
        trans = ((a["full"] if rs > 0 else 0.0) + a["ws"]) / cp
        layer_bwd = a["work"] / cp
        if lengths is not None and a["pair"] > 0 and len(lengths) > 0:
            s = np.asarray(lengths, dtype=float)
            tokens = float(s.sum())
            probs = a["pair"] * float(s @ s) / cp / tokens  # per token, one layer
            keep += (Ls - rs) * probs
            trans += probs if rs > 0 else 0.0
            # the attention's backward, one document at a time: the probabilities' gradient
            # and softmax-backward's output of the longest document, by when the layer's MLP
            # tensors are freed
            attn_bwd = 2.0 * a["pair"] * float(s.max()) ** 2 / cp / tokens - a["mlp"] / cp
            layer_bwd = max(layer_bwd, attn_bwd)
        trans += layer_bwd
        # (the last stage frees the final norm's input, `emb`, before its layers' backward:
        # over-counted there, ~2% with full recompute)
        extra = max(0.0, (a["last_keep"] + a["logits_trans"] + a["ws"]) / cp - trans)
        return keep, trans, extra

    def replica_peak_bytes(self, layout: Layout, mb_tokens: Sequence[float], mb_rs: Sequence[int],
                           mb_lengths: Sequence[Sequence[int]] | None = None) -> float:
        """Peak device memory of one replica running these micro-batches in this order.
        `mb_lengths` (optional): each micro-batch's padded document lengths, for the terms
        quadratic in them (see act_bytes_per_token)."""
        layout = Layout(*layout)
        k = len(mb_tokens)
        if k == 0:
            return self.state_bytes(layout)
        m = self.model
        # tied embeddings in one stage: the output layer's weight gradient waits for the
        # embedding's (autograd sums the two before accumulating), [V/tp, h] through the
        # layers' backward; with pp > 1 the last stage's output weight is a parameter of its own
        tied = m.vocab_size / layout.tp * m.hidden_size * m.activation_bytes \
            if (layout.pp == 1 and not m.untie_embeddings_and_output_weights) else 0.0
        keep = np.empty(k)
        trans = np.empty(k)
        last = np.empty(k)
        for i, (t, rs) in enumerate(zip(mb_tokens, mb_rs)):
            kp, tr, lg = self.act_bytes_per_token(layout, rs, None if mb_lengths is None else mb_lengths[i])
            keep[i], trans[i] = kp * t, tr * t
            last[i] = kp * t + max((tr + lg) * t, tr * t + tied)
        peak = float(last.max())
        pp = layout.pp
        if pp > 1:
            w = min(pp, k)
            cs = np.concatenate([[0.0], np.cumsum(keep)])
            win = cs[w:] - cs[:-w]
            # transient of the micro-batch being worked on, on top of the window it sits in
            tmax = np.array([trans[i : i + w].max() for i in range(k - w + 1)])
            peak = max(peak, float((win + tmax).max()))
        return self.state_bytes(layout) + peak

    def max_tokens(self, layout: Layout, rs: int, in_flight: int = 1) -> float:
        """Largest micro-batch (tokens) that fits with `in_flight` equal micro-batches held
        (1F1B stage 0 holds min(pp, count)). 0 when even the model state does not fit."""
        free = self.capacity_bytes - self.state_bytes(layout)
        if free <= 0:
            return 0.0
        kp, tr, lg = self.act_bytes_per_token(layout, rs)
        per = max(kp + tr + lg, in_flight * kp + tr)
        return free / per

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

"""Memory of one device under a replica layout: model state, activations, 1F1B windows.

Why a module of its own: the cost model's time half (`dcp_ext.planning.cost_model`) and
this memory half answer different questions (how long, does it fit) from different
inputs; CostModel inherits these methods, so callers still ask one object.

Memory (bytes per device): parameter and gradient shards of the layout, the optimizer's
fixed shard over all ranks, activations per token per layer with and without recompute,
the micro-batches 1F1B keeps in flight (stage 0 holds a window of pp), and the transient
output-layer logits. Recompute is counted in layers per stage (`rs`); the plan's
`recompute_layers` is the model-wide count, rs * pp.

With the local layers' math attention (CPU ranks, GPUs without transformer-engine) the
probabilities make activations quadratic in document lengths (`quadratic`): there a
micro-batch is checked by its padded documents (`padded_lengths`, `micro_batch_bytes`,
`fits_in_flight`, `max_doc_length`), not by its token count alone.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

from dcp_ext.data.lengths import round_up
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.specs import bucket_numel_for


class MemoryAccounting:
    """Memory methods of `CostModel` (it sets model, cluster, memory_margin and the
    shared-buffer fields `buffer_params`, `buffer_by_layout`, `stage_splits`, and `layers_per_stage`)."""

    @property
    def capacity_bytes(self) -> float:
        g = self.cluster.gpu
        cal = getattr(self, "calibration", None)  # online recalibration charges memory measured beyond the model
        measured = cal.memory_reserve if cal is not None else 0.0
        return g.memory_bytes * (1.0 - self.memory_margin) - g.reserved_bytes - measured

    def state_bytes(self, layout: Layout, split=None) -> float:
        """Persistent bytes on one device, as the runtime allocates them: the rank's shared
        parameter and fp32 main-grad buffers (sized to the largest stage it can play: this
        layout's, or the pool's when `charge_shared_buffers` was called), its shard of the
        optimizer state (fp32 master, fp32 gradient, Adam moments), the exchange buffers and
        the communicators beyond those the GPU kind's reserve has room for."""
        m = self.model
        buffer = self.buffer_params_for(layout, split)
        opt = m.num_params * m.optimizer_bytes_per_param / self.cluster.num_gpus
        return buffer * (m.param_bytes + m.grad_bytes) + opt + self.exchange_bytes + self.communicator_bytes

    @property
    def communicator_bytes(self) -> float:
        """Device bytes of a rank's communicators beyond the `reserved_communicators` that
        `reserved_bytes` has room for (`charge_communicators` sets the count)."""
        g = self.cluster.gpu
        return max(0, self.communicators - g.reserved_communicators) * g.communicator_bytes

    def charge_communicators(self, types) -> None:
        """Charge every layout the communicators (groups of two or more ranks) of the rank
        that belongs to the most of them, over the replica types `types` the runtime creates."""
        from dcp_ext.planning.layout import communicators_per_rank

        self.communicators = max(communicators_per_rank(types, self.cluster.num_gpus), default=0)

    def buffer_params_for(self, layout: Layout, split=None) -> float:
        """Parameters in the shared buffers of a device that runs `layout` (under `split`,
        a replica's stage_layers, when given)."""
        shared = self.buffer_by_layout.get(Layout(*layout), self.buffer_params)
        return max(self.heaviest_stage_params(layout, split), shared)

    def heaviest_stage_params(self, layout: Layout, split=None) -> float:
        """Parameters one rank holds for the heaviest stage of `layout`: the even split's
        (`ModelSpec.local_stage_params`), or under the stage split registered for it in
        `stage_splits` or given as `split` (uneven pipeline stages: stage 0 holds the
        embedding, the last the output layer and final norm)."""
        if split is None:
            split = self.stage_splits.get(Layout(*layout)) if self.stage_splits else None
        if not split:
            return self.model.local_stage_params(layout.tp, layout.pp)
        return max(self.stage_params_of(layout, split, p) for p in range(len(split)))

    def stage_params_of(self, layout: Layout, split, p: int) -> float:
        """Parameters one rank of pipeline stage `p` holds under the stage split `split`."""
        m, tp = self.model, layout.tp
        h = m.hidden_size
        layer = (m.layer_params - 2 * h) / tp + 2 * h
        emb = m.embedding_params / tp
        out = split[p] * layer
        if p == 0:
            out += emb
        if p == len(split) - 1:
            out += emb + h  # the output layer (or the tied copy) + final norm
        if len(split) == 1 and not m.untie_embeddings_and_output_weights:
            out -= emb  # one stage with tied embeddings holds the matrix once
        return out

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
        stage = self.heaviest_stage_params
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
    def act_terms(self, layout: Layout) -> dict:
        """Activation bytes per row of a micro-batch on one device (rows = T/cp tokens), from
        what autograd saves in megatron-core's layers (see the comment on each term).

        Measured exactly on the CPU by `benchmarks/bench_activation_memory.py` (TP1, TP2 with
        sequence parallel, CP2, PP2; with and without full recompute; packed and single
        documents): within a few percent. The terms of TE layers (TE attention, TE norms) and
        of the fused SwiGLU and RoPE follow TE's and megatron-core's code, not a measurement.

        Notation: e activation bytes, h hidden, f ffn, kv key/value width, d head dim,
        t = tp, sp = t when the sequence is split over TP (sequence parallel), else 1."""
        m = self.model
        t, cp = layout.tp, layout.cp
        e = m.activation_bytes
        h, f, kv, d, heads = m.hidden_size, m.ffn_hidden_size, m.kv_size, m.head_dim, m.num_attention_heads
        sp = t if (t == 1 or m.sequence_parallel) else 1
        # Which kernels the layers run: what the engine builds, as megatron/training/adaptive/run_config.py
        # records it in the ModelSpec (model_flags.uses_transformer_engine and config_fields):
        # - layer_kernels "local" (no transformer-engine: CPU ranks, and GPUs without TE or with
        #   --transformer-impl local / --attention-backend local): dcp_ext.runtime.stages.model's
        #   layer_spec puts megatron-core's local spec together with torch norms and the core
        #   attention of dcp_ext.runtime.stages.attention (--dcp-cpu-attention math|flash,
        #   `cpu_attention`); "te": TE layers (TE attention, norms fused into the GEMMs);
        # - fused_swiglu: bias-SwiGLU fused (on CUDA unless --no-bias-swiglu-fusion, either kind
        #   of layers); fused_rope: TE's fused RoPE (TE layers only, unless --no-rope-fusion).
        # Unset (a preset, a plan file of before), by the cluster as before: TE layers with both
        # fusions on GPU clusters, local and unfused on CPU ones (an unset fused_rope follows the
        # layers: TE's, so local layers on a GPU cluster keep the unfused RoPE).
        on_cpu = self.cluster.gpu.name.startswith("cpu")
        local = m.layer_kernels == "local" if m.layer_kernels is not None else on_cpu
        fused_swiglu = m.fused_swiglu if m.fused_swiglu is not None else not on_cpu
        fused_rope = m.fused_rope if m.fused_rope is not None else not local

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
        rope = 0.0 if fused_rope else 4.0 * d * e
        # MLP. Unfused gated unit (megatron-core's MLP.glu): fc1's output (2f, saved through
        # the x_glu view by silu), silu(x_glu) and x_linear + glu_linear_offset (a copy; both
        # saved by their product), the product (fc2's input): 5f. Fused bias-SwiGLU keeps
        # fc1's output and the product: 3f. GELU: fc1's output and gelu's: 2f.
        if m.swiglu:
            mlp = (3.0 if fused_swiglu else 5.0) * f * e / t
        else:
            mlp = 2.0 * f * e / t
        # dropout masks (1 byte) after attention and after the MLP
        drop = 2.0 * h / sp if m.hidden_dropout else 0.0
        flash = local and m.cpu_attention == "flash"
        if flash:
            # dcp_ext.runtime.stages.attention with --dcp-cpu-attention flash: SDPA on 4-D tensors
            # runs torch's flash kernel (the CPU's; CUDA's on a GPU), which keeps its inputs as
            # given, its output and fp32 log-sum-exp (heads/t values), measured on the CPU by
            # bench_activation_memory.py --cpu-attention flash. Without CP: q and k after RoPE
            # (h/t, kv/t), v's view keeps linear_qkv's whole output (h + 2kv)/t (GQA runs in the
            # kernel: nothing expanded). With CP the whole document's keys and values, gathered
            # and reordered (kv*cp/t each), and q. Then the concatenated output (linear_proj's
            # input, h/t). The float mask CP needs is quadratic (`pair`); no probabilities.
            qkv = (h + kv + (h + 2.0 * kv)) if cp == 1 else (h + 2.0 * kv * cp)
            attn = (qkv + h + h) * e / t + heads / t * 4.0
            norm_extra = 2.0 * (h + 1.0) * e / sp
        elif local:
            # dcp_ext.runtime.stages.attention: SDPA on 3-D [heads, s, d] tensors runs torch's math
            # path (the flash kernels take 4-D tensors, on the CPU and on CUDA). It keeps q*scale
            # (h/t), the GQA-expanded k*scale and v of the whole document (h/t each per key row:
            # a CP rank all-gathers keys and values, so cp key rows per local query row) and the
            # concatenated output (linear_proj's input, h/t); plus the softmax probabilities,
            # heads/t values per (query, key) pair of a document: quadratic in the document
            # lengths (`pair`, act_bytes_per_token). Without GQA and CP, v is never copied: its
            # view keeps linear_qkv's whole output (h + 2kv) instead. Nothing else of q, k, v
            # survives the forward.
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
        # by then), or gelu's input gradient and fc1's output gradient. (With the math attention,
        # long documents move the peak into the attention: see act_bytes_per_token.)
        work = 2.0 * f * e / t + h * e / sp
        # last stage: the final norm's output (the output layer's input) and, with local layers
        # (a torch norm), the norm's normalized copy and rsqrt; the fused native cross entropy
        # converts the logits to fp32 and keeps exp/softmax in that buffer (4 bytes per
        # vocabulary entry); its int64/bool target masks (9 bytes per row) are left out
        last_keep = h * e / sp + ((h + 1.0) * e / sp if local else 0.0) + m.vocab_size / t * 4.0
        # its backward: the logits gradient rounded to bf16 (megatron-core 0.16 does so in any
        # dtype), then autograd's cast back to the logits' dtype when that is not bf16
        logits_trans = m.vocab_size / t * (2.0 + (e if e != 2 else 0.0))
        # bytes per (query, key) pair of a document and layer: the math path's
        # probabilities (and, in the backward, their gradient: `pair_bwd`); the flash kernel's
        # float mask under CP, one value per pair for all heads
        if flash:
            pair, pair_bwd = (e if cp > 1 else 0.0), 0.0
        else:
            pair = pair_bwd = heads / t * e if local else 0.0
        return dict(full=full, ckpt=ckpt, emb=emb, work=work, ws=ws, mlp=mlp, last_keep=last_keep,
                    logits_trans=logits_trans, pair=pair, pair_bwd=pair_bwd)

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
        quadratic in them (the math attention's probabilities; none with TE); without them those
        terms are left out."""
        a = self.act_terms(Layout(*layout))
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
            attn_bwd = 2.0 * a["pair_bwd"] * float(s.max()) ** 2 / cp / tokens - a["mlp"] / cp
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
        tied = self.tied_bytes(layout)
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

    def tied_bytes(self, layout: Layout) -> float:
        """Tied embeddings in one stage: the output layer's weight gradient waits for the
        embedding's (autograd sums the two before accumulating), [V/tp, h] through the
        layers' backward; with pp > 1 the last stage's output weight is a parameter of its own."""
        m = self.model
        return m.vocab_size / layout.tp * m.hidden_size * m.activation_bytes \
            if (layout.pp == 1 and not m.untie_embeddings_and_output_weights) else 0.0

    # ------------------------------------------------------------------ quadratic memory
    # Where activations grow with the square of document lengths (the local layers' math
    # attention keeps its probabilities: `pair` > 0; never with TE) a token count does not say
    # whether a micro-batch fits: the planners then check its padded documents with the methods
    # below, the same arithmetic as replica_peak_bytes, which the simulator's memory check runs.
    def quadratic(self, layout: Layout) -> bool:
        """Whether this layout's activation memory has a term quadratic in document lengths."""
        return self.act_terms(Layout(*layout))["pair"] > 0

    def padded_lengths(self, layout: Layout, lengths: Sequence[int]) -> list[int]:
        """A micro-batch's document lengths as the runtime pads them under `layout` (the
        engine's padding_for, dcp_ext.data.thd's rule): each document to a multiple of 2*cp
        with context parallelism, the pack's total to a multiple of tp*cp with sequence
        parallelism, that extra on the last document."""
        lay = Layout(*layout)
        each = 2 * lay.cp if lay.cp > 1 else 1
        total = lay.tp * lay.cp if (lay.tp > 1 and self.model.sequence_parallel) else 1
        out = [round_up(int(n), each) for n in lengths]
        if out:
            whole = sum(out)
            out[-1] += round_up(whole, math.lcm(each, total)) - whole
        return out

    def micro_batch_bytes(self, layout: Layout, rs: int, lengths: Sequence[int]) -> tuple[float, float, float]:
        """(kept while in flight, transient, peak alone on the last stage) activation bytes of
        one micro-batch of these padded document lengths on one device: the terms
        replica_peak_bytes combines, for one micro-batch of sum(lengths) tokens."""
        layout = Layout(*layout)
        t = float(sum(lengths))
        kp, tr, lg = self.act_bytes_per_token(layout, rs, lengths)
        return kp * t, tr * t, kp * t + max((tr + lg) * t, tr * t + self.tied_bytes(layout))

    def fits_in_flight(self, layout: Layout, rs: int, lengths: Sequence[int], in_flight: int = 1) -> bool:
        """Whether a micro-batch of these padded lengths fits beside the model state alone and,
        for in_flight > 1, with in_flight - 1 like it held (1F1B's window): max_tokens'
        question asked of documents instead of tokens."""
        keep, trans, alone = self.micro_batch_bytes(layout, rs, lengths)
        free = self.capacity_bytes - self.state_bytes(Layout(*layout))
        return alone <= free and (in_flight <= 1 or in_flight * keep + trans <= free)

    def max_doc_length(self, layout: Layout, rs: int, in_flight: int = 1) -> int:
        """Longest document (real length, padded as the runtime pads it alone) that
        fits_in_flight at `rs`; 0 if none. The fit is monotone in the length, so bisection on
        1 .. max_tokens (which bounds it: the token terms alone already have to fit)."""
        layout = Layout(*layout)
        lo, hi = 0, int(self.max_tokens(layout, rs, in_flight))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits_in_flight(layout, rs, self.padded_lengths(layout, [mid]), in_flight):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def max_tokens(self, layout: Layout, rs: int, in_flight: int = 1) -> float:
        """Largest micro-batch (tokens) that fits with `in_flight` equal micro-batches held
        (1F1B stage 0 holds min(pp, count)). 0 when even the model state does not fit."""
        free = self.capacity_bytes - self.state_bytes(layout)
        if free <= 0:
            return 0.0
        kp, tr, lg = self.act_bytes_per_token(layout, rs)
        most = free / max(kp + tr + lg, in_flight * kp + tr)
        tied = self.tied_bytes(layout)  # replica_peak_bytes: the last stage's transient is at least tr*t + tied
        if tied > 0:
            most = min(most, max(0.0, free - tied) / (kp + tr))
        return most

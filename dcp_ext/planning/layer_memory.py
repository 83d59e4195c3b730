"""Peak device memory of a replica whose micro-batches run layer strategies, or whose stages are uneven.

Why it exists: with per-layer (tp, cp) strategies (ParaDySe) a layer's activations follow
its strategy and the replica also holds, for every (layer, strategy other than home)
that any of its micro-batches uses, that layer's parameters in that strategy's shape
(compute dtype) plus an fp32 main gradient; with uneven stages (OmniBal) each stage holds
its own number of layers and its own 1F1B window. `cost_memory.replica_peak_bytes`
prices the uniform case (identical stages, one strategy); this module prices every stage
of the general one with the same per-row terms (`act_terms`), so that on a uniform
replica both give the same bytes.

Per stage p (layers [first, end), 1F1B keeps min(pp - p, m) micro-batches in flight):
  kept per micro-batch = tokens * (sum over its layers of full / cp_s, or the checkpoint
      when recomputed, + the stage output in the home strategy);
  transient = tokens * max over its layers of that layer's backward peak;
  the last stage: also the output layer and loss in the home strategy, as `act_bytes_per_token`.
The all-to-all buffers of a re-layout ([tokens_local, hidden], a layer's transient is
many times that) are left out.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layer_cost import Strategy, layer_local_params, stage_bounds, stage_layout, stage_recompute
from dcp_ext.planning.layout import Layout


def _terms(cm: CostModel, s: Strategy, pp: int) -> dict:
    a = cm.act_terms(Layout(s[0], s[1], pp))
    cp = s[1]
    return {k: v / cp for k, v in a.items()}


def stage_micro_batch_bytes(cm: CostModel, layout: Layout, groups: Counter, tokens: float,
                            lengths: Sequence[int] | None, last: bool) -> tuple[float, float, float]:
    """(kept, transient, peak alone) bytes of one micro-batch on one stage whose layers are
    `groups` ((strategy, recomputed) -> count), `lengths` its padded documents (for the
    terms quadratic in them; None: left out)."""
    home = (layout.tp, layout.cp)
    h = _terms(cm, home, layout.pp)
    quad = lengths is not None and len(lengths) > 0 and h["pair"] > 0
    if quad:
        s = np.asarray(lengths, dtype=float)
        t_real = float(s.sum())
        sq, smax2 = float(s @ s), float(s.max()) ** 2
    keep = h["emb"]
    trans = 0.0
    for (strategy, rec), count in groups.items():
        a = h if tuple(strategy) == home else _terms(cm, strategy, layout.pp)
        probs = a["pair"] * sq / t_real if quad else 0.0
        layer_bwd = a["work"]
        if quad:
            layer_bwd = max(layer_bwd, 2.0 * a["pair"] * smax2 / t_real - a["mlp"])
        if rec:
            keep += count * a["ckpt"]
            tr = a["full"] + a["ws"] + probs + layer_bwd
        else:
            keep += count * (a["full"] + probs)
            tr = a["ws"] + layer_bwd
        trans = max(trans, tr)
    keep_b, trans_b = keep * tokens, trans * tokens
    alone = keep_b + trans_b
    if last:
        extra = max(0.0, h["last_keep"] + h["logits_trans"] + h["ws"] - trans)
        tied = cm.tied_bytes(layout)
        alone = keep_b + max((trans + extra) * tokens, trans_b + tied)
    return keep_b, trans_b, alone


def extra_param_bytes(cm: CostModel, used: set, first: int, end: int) -> float:
    """Parameters (compute dtype) and fp32 main grads of the stage's layers held in a
    strategy other than home: `used` is the replica's set of (layer, strategy)."""
    m = cm.model
    per = m.param_bytes + m.grad_bytes
    return sum(layer_local_params(cm, s[0]) * per for layer, s in used if first <= layer < end)


def replica_peak_v2(cm: CostModel, layout: Layout, split, micro_batches: Sequence[tuple[float, int, object, object]],
                    used: set | None = None) -> float:
    """Peak bytes on any device of a replica: micro_batches are (tokens, recompute_layers,
    layer_strategies or None, padded lengths or None) in schedule order; `used` the
    (layer, strategy) pairs held besides home (default: from the micro-batches)."""
    layout = Layout(*layout)
    L = cm.model.num_layers
    home = (layout.tp, layout.cp)
    if used is None:
        used = set()
        for _, _, strategies, _ in micro_batches:
            for st in strategies or ():
                if (st.tp, st.cp) != home:
                    used.update((layer, (st.tp, st.cp)) for layer in range(st.first, st.last + 1))
    state = cm.state_bytes(layout, tuple(split) if split else None)
    pp = layout.pp
    k = len(micro_batches)
    quadratic = cm.quadratic(layout)
    tokens = np.array([float(t) for t, _, _, _ in micro_batches])
    keys: dict = {}
    for i, (_, R, strategies, _) in enumerate(micro_batches):
        keys.setdefault((R, tuple(strategies) if strategies else None), []).append(i)
    tied = cm.tied_bytes(layout)
    peak = 0.0
    for p, (first, end) in enumerate(stage_bounds(L, pp, split)):
        base = state + extra_param_bytes(cm, used, first, end)
        if k == 0:
            peak = max(peak, base)
            continue
        last = p == pp - 1
        keep, trans, alone = np.empty(k), np.empty(k), np.empty(k)
        for (R, strategies), idx in keys.items():
            groups, _ = stage_layout(L, first, end, strategies, home, stage_recompute(R, end - first, L))
            if quadratic:
                for i in idx:
                    keep[i], trans[i], alone[i] = stage_micro_batch_bytes(cm, layout, groups, tokens[i],
                                                                          micro_batches[i][3], last)
                continue
            kp, tr, al = stage_micro_batch_bytes(cm, layout, groups, 1.0, None, last)
            t = tokens[idx]
            keep[idx], trans[idx] = kp * t, tr * t
            # alone = keep + max((trans + extra) * T, trans * T + tied), extra per token
            ex = (al - kp - tr) if not last or tied == 0.0 else _extra_per_token(cm, layout, groups)
            alone[idx] = kp * t + (np.maximum((tr + ex) * t, tr * t + tied) if last else tr * t)
        act = float(alone.max()) if last else 0.0
        w = min(pp - p, k)
        if not last or w > 1:
            cs = np.concatenate([[0.0], np.cumsum(keep)])
            win = cs[w:] - cs[:-w]
            tmax = np.lib.stride_tricks.sliding_window_view(trans, w).max(axis=1)
            act = max(act, float((win + tmax).max()))
        peak = max(peak, base + act)
    return peak


def _extra_per_token(cm: CostModel, layout: Layout, groups: Counter) -> float:
    """The last stage's output-layer extra per token (stage_micro_batch_bytes' `extra`)."""
    home = (layout.tp, layout.cp)
    h = _terms(cm, home, layout.pp)
    _, trans, _ = stage_micro_batch_bytes(cm, layout, groups, 1.0, None, False)
    return max(0.0, h["last_keep"] + h["logits_trans"] + h["ws"] - trans)

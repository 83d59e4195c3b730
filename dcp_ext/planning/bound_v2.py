"""The lower bound widened to plans with layer strategies and uneven stages (plan contract v2).

Why it exists: `bound.lower_bound` relaxes every v1 plan, whose replicas run one (tp, cp)
throughout and whose pipeline stages are identical (each priced as the cost model's
stage, output layer included). A v2 plan can run each layer under another re-factoring
of the replica's ranks, and with a stage split its stages are priced one by one (only
the last pays the output layer), so it may cost less than any v1 plan and the v1 bound
would not bound it. This module feeds `bound.bound_tables` a relaxed price list and
weakens what the relaxation no longer proves:

  * time: per layout (tp, cp, pp), each coefficient is the least over the re-factorings
    (tp', cp') of tp*cp of that coefficient of a layer (`layer_cost`), times the layers of
    a stage, plus the least over stage kinds (identical, or the average of a split's
    first, middle and last stages) of the fixed part's; the context-parallel exchange
    excess (>= 0) and re-layouts (>= 0) are left out;
  * memory: per-row activation terms the least over the re-factorings; the model state
    the layout's own (layer strategies only add parameters);
  * pipelines: stages may differ, so the makespan is only known to exceed max over stages
    of (stage work + p * the least forward+backward constant): at least the average
    stage's work + (pp-1)/2 of that constant; the bubble floors (2) and (3) of `bound`,
    proven for identical stages, are dropped, and so are the micro-batch constants memory
    forces (a split's first stage, which holds pp micro-batches, may have fewer layers).
Layouts whose memory is quadratic in document lengths (the CPU) keep their own prices:
the planner gives them neither feature.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dcp_ext.planning.bound import bound_tables, lower_bound
from dcp_ext.planning.cost_model import CostModel, StageCoeffs
from dcp_ext.planning.layer_cost import LayerPrices, refactorings
from dcp_ext.planning.layout import Layout

_FIELDS = ("a_f", "b_f", "c_f", "c0_f", "a_b", "b_b", "c_b", "c0_b")


class RelaxedPrices:
    """The cost-model methods `bound.bound_tables` calls, relaxed as the module docstring says."""

    def __init__(self, cm: CostModel):
        self.cm = cm
        self.lp = LayerPrices(cm)
        self.cluster, self.model = cm.cluster, cm.model
        self.capacity_bytes = cm.capacity_bytes
        self._coeffs: dict = {}

    def __getattr__(self, name):  # sync_time, state_bytes, layers_per_stage, all_layouts, ...
        return getattr(self.cm, name)

    def _strategies(self, lay: Layout):
        return refactorings(self.cm, lay.tp, lay.cp) or [(lay.tp, lay.cp)]

    def coeffs(self, lay: Layout, rs: int = 0) -> StageCoeffs:
        lay = Layout(*lay)
        if self.cm.quadratic(lay):
            return self.cm.coeffs(lay, rs)
        key = (lay, int(rs))
        got = self._coeffs.get(key)
        if got is None:
            Ls = self.cm.layers_per_stage(lay)
            rs = min(int(rs), Ls)
            layer = [self.lp.layers(s, lay.pp, Ls, rs) for s in self._strategies(lay)]
            kinds = [self.lp.fixed((lay.tp, lay.cp), lay.pp, "same")]
            if lay.pp > 1:
                w = [self.lp.fixed((lay.tp, lay.cp), lay.pp, k) for k in ("first", "middle", "last")]
                kinds.append(StageCoeffs(**{f: (getattr(w[0], f) + (lay.pp - 2) * getattr(w[1], f)
                                                + getattr(w[2], f)) / lay.pp for f in _FIELDS}))
            vals = {f: min(getattr(c, f) for c in layer) + min(getattr(k, f) for k in kinds) for f in _FIELDS}
            got = self._coeffs[key] = StageCoeffs(**vals)
        return got

    def _rows(self, lay: Layout) -> dict:
        """Per-row terms (already / cp) least over the re-factorings."""
        out: dict = {}
        for s in self._strategies(lay):
            a = self.cm.act_terms(Layout(s[0], s[1], lay.pp))
            for k, v in a.items():
                out[k] = min(out.get(k, np.inf), v / s[1])
        return out

    def act_bytes_per_token(self, lay: Layout, rs: int, lengths=None):
        lay = Layout(*lay)
        if self.cm.quadratic(lay):
            return self.cm.act_bytes_per_token(lay, rs, lengths)
        a = self._rows(lay)
        Ls = self.cm.layers_per_stage(lay)
        rs = min(rs, Ls)
        keep = (Ls - rs) * a["full"] + rs * a["ckpt"] + a["emb"]
        trans = (a["full"] if rs > 0 else 0.0) + a["ws"] + a["work"]
        extra = max(0.0, a["last_keep"] + a["logits_trans"] + a["ws"] - trans)
        return keep, trans, extra

    def max_tokens(self, lay: Layout, rs: int, in_flight: int = 1) -> float:
        free = self.capacity_bytes - self.cm.state_bytes(lay)
        if free <= 0:
            return 0.0
        kp, tr, lg = self.act_bytes_per_token(lay, rs)
        return free / max(kp + tr + lg, in_flight * kp + tr)


def lower_bound_v2(cm: CostModel, lengths: Sequence[int], layouts: Sequence[Layout] | None = None,
                   refine: bool = True) -> float:
    """A time no v1 or v2 plan of this batch can beat on this cluster (module docstring)."""
    if len(lengths) == 0:
        return 0.0
    rp = RelaxedPrices(cm)
    tb = bound_tables(rp, lengths, layouts)
    pipe = tb.q > 0
    tb.psi[:, pipe] = -np.inf
    tb.cv[pipe] = -np.inf
    tb.c0fb[pipe] = 0.5 * tb.c0fb[pipe]
    tb.x1[:, pipe] = tb.x0[:, pipe]  # a split's first stage may hold fewer layers: no memory-forced constants
    return lower_bound(cm, lengths, tables=tb, refine=refine, pipeline=False)

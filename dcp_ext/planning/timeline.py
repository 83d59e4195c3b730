"""A PNG timeline of one simulated iteration: replicas as lanes, micro-batches as boxes.

Why it exists: a table says how long an iteration takes; the picture says why (which
replica is last, how big the pipeline bubbles are, how much is parameter sync). matplotlib
is imported only when a picture is asked for.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.planning.simulator import one_f_one_b, one_f_one_b_stages, replica_stage_times


def timeline_rows(cm: CostModel, it: IterationPlan, length_of: Mapping[int, int]):
    """Per replica: (label, sync_pull, list of (stage, mb, kind, start, end), push_start, push_end)."""
    R = len(it.replicas)
    rows = []
    for k, rep in enumerate(it.replicas):
        lay = Layout(rep.tp, rep.cp, rep.pp)
        sync = cm.sync_time(lay, R)
        pull = sync * cm.model.param_bytes / (cm.model.param_bytes + cm.model.grad_reduce_bytes)
        label = f"r{k} {rep.replica_type.label() if rep.stage_layers else lay} ranks {rep.ranks[0]}-{rep.ranks[-1]}"
        if rep.uses_v2():  # stages of their own (uneven, layer strategies)
            sf, sb = replica_stage_times(cm, rep, length_of)
            res = one_f_one_b_stages(sf, sb, lay.pp, record=True)
            rows.append((label, pull, res.events, pull + res.makespan, sync + res.makespan))
            continue
        fwd, bwd = [], []
        for mb in rep.micro_batches:
            v = np.array([length_of[i] for i in mb.sample_ids], dtype=float)
            rs = cm.stage_recompute(lay, mb.recompute_layers)
            f, b = cm.coeffs(lay, rs).mb_fwd_bwd(float(v @ v), float(v.sum()), len(v))
            fwd.append(f)
            bwd.append(b)
        res = one_f_one_b(fwd, bwd, lay.pp, record=True)
        rows.append((label, pull, res.events, pull + res.makespan, sync + res.makespan))
    return rows


def render_timeline(cm: CostModel, it: IterationPlan, length_of: Mapping[int, int], path: str, title: str = "",
                    max_lanes: int = 80) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = timeline_rows(cm, it, length_of)
    if len(rows) > max_lanes:  # keep the slowest lanes readable
        order = sorted(range(len(rows)), key=lambda k: -rows[k][4])[:max_lanes]
        rows = [rows[k] for k in sorted(order)]
    lanes = []
    for label, pull, events, push_start, end in rows:
        pp = max((e[0] for e in events), default=0) + 1
        lanes.append((label, pp, pull, events, push_start, end))
    height = sum(l[1] for l in lanes)
    fig, ax = plt.subplots(figsize=(14, max(3.0, 0.22 * height + 1.5)))
    y = 0
    cmap = plt.get_cmap("tab20")
    yticks, ylabels = [], []
    for label, pp, pull, events, push_start, end in lanes:
        for st in range(pp):
            yy = y + st
            ax.barh(yy, pull, left=0, height=0.8, color="#bbbbbb", edgecolor="none")
            ax.barh(yy, end - push_start, left=push_start, height=0.8, color="#888888", edgecolor="none")
        for stage, mb, kind, s0, s1 in events:
            color = cmap(mb % 20)
            ax.barh(y + stage, s1 - s0, left=pull + s0, height=0.8, color=color,
                    edgecolor="black", linewidth=0.3, alpha=1.0 if kind == "F" else 0.6,
                    hatch=None if kind == "F" else "//")
        yticks.append(y + (pp - 1) / 2)
        ylabels.append(label)
        y += pp
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (grey: parameter pull / gradient push; solid: forward, hatched: backward)")
    ax.set_title(title or f"iteration {it.index}: predicted {it.predicted_time_s:.3f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

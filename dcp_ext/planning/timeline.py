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


def lane_groups(labels: list[tuple[int, str, tuple[int, ...]]]) -> list[tuple[int, int, str]]:
    """Runs of consecutive replicas of one layout: (first lane, last lane, label). `labels`:
    (replica index, layout, ranks) per lane. A run of one is labelled as the replica itself."""
    groups = []
    i = 0
    while i < len(labels):
        j = i
        while j + 1 < len(labels) and labels[j + 1][1] == labels[i][1]:
            j += 1
        (k0, lay, r0), (k1, _, r1) = labels[i], labels[j]
        size = len(r0)
        ranks = f"rank {r0[0]}" if size == 1 and i == j else f"ranks {r0[0]}-{r1[-1]}"
        if i == j:
            groups.append((i, j, f"r{k0} {lay}, {ranks}"))
        else:
            groups.append((i, j, f"r{k0}-r{k1}: {j - i + 1} x {lay}, {ranks}"
                                 + (f" ({size} each)" if size > 1 else "")))
        i = j + 1
    return groups


def render_timeline(cm: CostModel, it: IterationPlan, length_of: Mapping[int, int], path: str, title: str = "",
                    max_lanes: int = 80, lane_labels_up_to: int = 24) -> str:
    """The iteration's timeline (`timeline_figure`) as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = timeline_figure(cm, it, length_of, title, max_lanes, lane_labels_up_to)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def timeline_figure(cm: CostModel, it: IterationPlan, length_of: Mapping[int, int], title: str = "",
                    max_lanes: int = 80, lane_labels_up_to: int = 24):
    """Draw the iteration: one lane per pipeline stage of every replica, a legend of what the
    colours mean, and labels readable at any size: one per replica up to `lane_labels_up_to`
    replicas, beyond that one per run of replicas of the same layout (`lane_groups`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.patches import Patch

    rows = timeline_rows(cm, it, length_of)
    described = [(k, rep.replica_type.label() if rep.stage_layers else str(Layout(rep.tp, rep.cp, rep.pp)),
                  tuple(rep.ranks)) for k, rep in enumerate(it.replicas)]
    shown = len(rows)
    if len(rows) > max_lanes:  # keep the slowest lanes readable
        order = sorted(sorted(range(len(rows)), key=lambda k: -rows[k][4])[:max_lanes])
        rows, described = [rows[k] for k in order], [described[k] for k in order]
        shown = max_lanes
    lanes = []
    for label, pull, events, push_start, end in rows:
        pp = max((e[0] for e in events), default=0) + 1
        lanes.append((label, pp, pull, events, push_start, end))
    height = sum(l[1] for l in lanes)
    fig_h = max(3.5, 0.3 * height + 2.2)
    fig, ax = plt.subplots(figsize=(14, fig_h))
    cmap = plt.get_cmap("tab20")
    pull_color, push_color = "#c8c8c8", "#7a7a7a"
    starts, y = [], 0
    for label, pp, pull, events, push_start, end in lanes:
        starts.append(y)
        for st in range(pp):
            ax.barh(y + st, pull, left=0, height=0.8, color=pull_color, edgecolor="none")
            ax.barh(y + st, end - push_start, left=push_start, height=0.8, color=push_color, edgecolor="none")
        for stage, mb, kind, s0, s1 in events:
            ax.barh(y + stage, s1 - s0, left=pull + s0, height=0.8, color=cmap(mb % 20), edgecolor="black",
                    linewidth=0.3, alpha=1.0 if kind == "F" else 0.6, hatch=None if kind == "F" else "//")
        y += pp
    starts.append(y)
    if len(lanes) <= lane_labels_up_to:
        ticks = [(starts[i] + starts[i + 1] - 1) / 2 for i in range(len(lanes))]
        names = [f"r{k} {lay}, " + (f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}")
                 + (f" (pp{lanes[i][1]})" if lanes[i][1] > 1 else "") for i, (k, lay, r) in enumerate(described)]
    else:  # one label per run of same-layout replicas, a line between runs
        ticks, names = [], []
        for first, last, name in lane_groups(described):
            ticks.append((starts[first] + starts[last + 1] - 1) / 2)
            names.append(name)
            if first:
                ax.axhline(starts[first] - 0.5, color="black", linewidth=0.6)
        ax.set_yticks([s + 0.0 for s in starts[:-1]], minor=True)
    ax.set_yticks(ticks)
    ax.set_yticklabels(names, fontsize=9)
    ax.set_ylim(y - 0.5, -0.5)  # first replica on top
    ax.set_xlabel("seconds", fontsize=10)
    note = f" (the {shown} slowest of {len(it.replicas)} replicas)" if shown < len(it.replicas) else ""
    ax.set_title((title or f"iteration {it.index}: predicted {it.predicted_time_s:.3f} s") + note, fontsize=11)
    first_mbs = tuple(Patch(facecolor=cmap(i), edgecolor="black", linewidth=0.3) for i in range(4))
    handles = [Patch(facecolor=pull_color, label="parameter pull"), Patch(facecolor=push_color, label="gradient push"),
               Patch(facecolor="white", edgecolor="black", linewidth=0.5, label="forward (solid)"),
               Patch(facecolor="white", edgecolor="black", linewidth=0.5, hatch="//", alpha=0.6,
                     label="backward (hatched)"), first_mbs]
    labels = [h.get_label() for h in handles[:4]] + ["micro-batch 0, 1, 2, ... of its replica (colours repeat after 20)"]
    ax.legend(handles, labels, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, loc="upper center",
              bbox_to_anchor=(0.5, -0.55 / (fig_h - 1.2)), ncol=5, fontsize=9, frameon=False)  # below the x label
    fig.tight_layout()
    return fig

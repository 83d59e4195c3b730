"""Uneven pipeline stages (OmniBal): one layer split per pipelined layout, chosen once per run.

Why it exists: an even split gives every stage L/pp layers, but the first stage also runs
the embedding and the last the output layer and loss; with a large vocabulary the last
stage is the pipeline's slowest and every other stage waits for it. OmniBal balances
stages by their measured time instead. Here the times are the cost model's
(`dcp_ext.planning.layer_cost`: a stage is its fixed part plus its layers), at a typical
micro-batch of the layout (its no-recompute token cap, documents as long as the length
sample's token-weighted mean). The runtime builds one model per replica type and the
split is part of the type, so the split is fixed per layout, chosen when the planner is
built: the planner's set of replica types stays what it was.

The split minimises the slowest stage's time (every stage >= 1 layer); among splits as
fast, the one closest to even. Memory: the split must keep every stage within device
memory for the layout's token caps (`TypeTable`: alone and with pp in flight, at every
recompute level the planner may use), checked stage by stage (`layer_memory`), its
heavier buffers included; a stage that would not fit gets fewer layers, down to the even
split, which always fits (the caps were computed for it).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layer_cost import LayerPrices, where_of
from dcp_ext.planning.layer_memory import replica_peak_v2
from dcp_ext.planning.layout import Layout


def reference_micro_batch(tokens: float, length_sample: Sequence[int]) -> tuple[float, float, float]:
    """(sum s^2, tokens, documents) of a micro-batch of `tokens` whose documents are as long
    as the sample's token-weighted mean (documents longer than the micro-batch cut to it)."""
    s = np.minimum(np.asarray(length_sample, dtype=float), max(tokens, 1.0))
    if len(s) == 0 or tokens <= 0:
        return 0.0, 0.0, 0.0
    mean_w = float((s * s).sum() / s.sum())  # the length a random token's document has
    return tokens * mean_w, float(tokens), max(1.0, tokens / mean_w)


def stage_times(lp: LayerPrices, layout: Layout, split: Sequence[int], ref) -> list[float]:
    """Forward + backward seconds of each stage for the reference micro-batch, no recompute."""
    layout = Layout(*layout)
    home = (layout.tp, layout.cp)
    out = []
    for p, n in enumerate(split):
        f, b = lp.fixed(home, layout.pp, where_of(p, layout.pp, split)).mb_fwd_bwd(*ref)
        gf, gb = lp.layers(home, layout.pp, n, 0).mb_fwd_bwd(*ref)
        out.append(f + b + gf + gb)
    return out


def _fastest(fixed: list[float], per_layer: float, num_layers: int, caps: list[int]) -> list[int] | None:
    """Layers per stage (1 <= n_p <= caps[p], sum num_layers) minimising max_p fixed[p] + n_p *
    per_layer; among those, the closest to even."""
    pp = len(fixed)
    if sum(caps) < num_layers or min(caps) < 1:
        return None
    if pp > 2:
        return _fastest_first_last(fixed, per_layer, num_layers, caps)
    cands = sorted({f + n * per_layer for f in fixed for n in range(1, num_layers + 1)})

    def room(T):
        return [min(caps[p], int(math.floor((T - fixed[p]) / per_layer + 1e-9))) if per_layer > 0 else caps[p]
                for p in range(pp)]

    best = None
    lo, hi = 0, len(cands) - 1
    while lo <= hi:  # the least candidate time at which the layers fit
        mid = (lo + hi) // 2
        r = room(cands[mid])
        if min(r) >= 1 and sum(r) >= num_layers:
            best, hi = r, mid - 1
        else:
            lo = mid + 1
    if best is None:
        return None
    # within those limits, as even as possible: fill the stages lowest first
    even = num_layers // pp
    split = [min(best[p], max(1, even)) for p in range(pp)]
    while sum(split) > num_layers:
        p = max(range(pp), key=lambda p: (split[p], p))
        split[p] -= 1
    while sum(split) < num_layers:
        p = min((p for p in range(pp) if split[p] < best[p]), key=lambda p: (split[p], -p))
        split[p] += 1
    return split


def _fastest_first_last(fixed: list[float], per_layer: float, num_layers: int, caps: list[int]) -> list[int] | None:
    """As `_fastest`, among the splits the runtime can build with pp > 2 (megatron-core's
    uneven split moves only the first and the last stage): [first, m, ..., m, last]."""
    pp = len(fixed)
    best, best_key = None, None
    for first in range(1, caps[0] + 1):
        for last in range(1, caps[-1] + 1):
            rest = num_layers - first - last
            if rest < pp - 2 or rest % (pp - 2):
                continue
            m = rest // (pp - 2)
            split = [first] + [m] * (pp - 2) + [last]
            if any(n > c for n, c in zip(split, caps)):
                continue
            slowest = max(f + n * per_layer for f, n in zip(fixed, split))
            key = (round(slowest, 15), sum(abs(n - num_layers / pp) for n in split))
            if best_key is None or key < best_key:
                best, best_key = split, key
    return best


def _fits(cm: CostModel, layout: Layout, split, tables) -> int | None:
    """None if the split keeps every stage within memory at the table's caps, else the
    first stage that overflows."""
    layout = Layout(*layout)
    cap = cm.capacity_bytes * (1 + 1e-9)
    tt = tables
    cases = []
    for i, rs in enumerate(tt.allowed_rs):
        R = cm.recompute_layers(layout, rs)
        cases.append([(float(tt.caps_alone[i]), R, None, None)])
        if layout.pp > 1 and tt.caps_window:
            cases.append([(float(tt.caps_window[i]), R, None, None)] * layout.pp)
    for mbs in cases:
        if mbs[0][0] <= 0:
            continue
        if replica_peak_v2(cm, layout, split, mbs) > cap:
            for p in range(layout.pp):  # which stage: the one whose own check fails
                if _stage_peak(cm, layout, split, mbs, p) > cap:
                    return p
            return 0
    return None


def _stage_peak(cm: CostModel, layout: Layout, split, mbs, p: int) -> float:
    """Peak of stage p alone (replica_peak_v2 restricted to one stage)."""
    from dcp_ext.planning.layer_cost import stage_bounds, stage_layout, stage_recompute
    from dcp_ext.planning.layer_memory import stage_micro_batch_bytes

    L = cm.model.num_layers
    first, end = stage_bounds(L, layout.pp, split)[p]
    home = (layout.tp, layout.cp)
    last = p == layout.pp - 1
    rows = []
    for tokens, R, strategies, lengths in mbs:
        groups, _ = stage_layout(L, first, end, strategies, home, stage_recompute(R, end - first, L))
        rows.append(stage_micro_batch_bytes(cm, layout, groups, tokens, lengths, last))
    w = min(layout.pp - p, len(rows))
    act = max(r[2] for r in rows) if last else max(sum(r[0] for r in rows[:w]) + max(r[1] for r in rows[:w]), 0.0)
    return cm.state_bytes(layout, tuple(split)) + act


def balanced_split(cm: CostModel, layout: Layout, table, length_sample: Sequence[int],
                   lp: LayerPrices | None = None) -> tuple[int, ...]:
    """The layout's stage split (see the module docstring); pp == 1: (num_layers,)."""
    layout = Layout(*layout)
    L, pp = cm.model.num_layers, layout.pp
    even = [L // pp] * pp
    if pp == 1:
        return (L,)
    lp = lp or LayerPrices(cm)
    ref = reference_micro_batch(table.cap_mb, length_sample)
    if ref[1] <= 0:
        return tuple(even)
    home = (layout.tp, layout.cp)
    per_layer = sum(lp.layer(home, pp).mb_fwd_bwd(*ref))
    fixed = [sum(lp.fixed(home, pp, where_of(p, pp, even)).mb_fwd_bwd(*ref)) for p in range(pp)]
    caps = [L - (pp - 1)] * pp
    for _ in range(L * pp):
        split = _fastest(fixed, per_layer, L, caps)
        if split is None:
            return tuple(even)
        if max(stage_times(lp, layout, split, ref)) >= max(stage_times(lp, layout, even, ref)) * (1 - 1e-9):
            return tuple(even)  # nothing to gain: the even split
        bad = _fits(cm, layout, split, table)
        if bad is None:
            return tuple(split)
        caps[bad] = max(1, min(caps[bad], split[bad]) - 1)
        if caps[bad] < even[bad]:
            return tuple(even)
    return tuple(even)


def choose_stage_splits(cm: CostModel, layouts: Sequence[Layout], tables: dict, length_sample: Sequence[int],
                        even: bool) -> None:
    """One split per pipelined layout of `layouts` (`balanced_split`, or the even split with
    `even`: every stage priced on its own, the control for what balancing buys), registered
    with the cost model (`cm.stage_splits`: its memory and the replica types follow it).
    Layouts whose memory is quadratic in lengths, or without a table, keep the even split."""
    from dcp_ext.planning.simulator import layer_prices

    L = cm.model.num_layers
    for lay in layouts:
        if lay.pp == 1 or cm.quadratic(lay) or lay not in tables:
            continue
        split = (L // lay.pp,) * lay.pp if even else balanced_split(cm, lay, tables[lay], length_sample, layer_prices(cm))
        cm.stage_splits[lay] = tuple(split)

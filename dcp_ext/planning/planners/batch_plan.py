"""The plan of one global batch on the planner's pool: the adaptive planner's per-iteration job.

Why a module of its own: the adaptive planner (`planners.adaptive`) keeps what lasts over a
run (the candidate pool, chosen at start and again from measured prices; the layout it runs
now). What it does with one batch is a pure function of the batch, the price tables, the
pool and that layout, written here:

  1. every pool entry priced by the water-filling estimate (`batch_prep.screen`);
  2. the best estimates (and the current layout, when staying on it is plausible) planned in
     full: stage 1 (`stage1.assign_documents`) then stage 2 (`packing.pack_and_price`), the
     side plan (`side_plan`: stage 1 by search) beside the leading one;
  3. the fastest full plan kept (within 0.2%, the one with more, smaller replicas), unless
     switching away from the current layout gains less than its cost plus a margin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_ext.planning.layout import LayoutMix
from dcp_ext.planning.planners.batch_prep import BatchPrep, screen
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica, pack_and_price
from dcp_ext.planning.planners.side_plan import side_plan
from dcp_ext.planning.planners.stage1 import assign_documents


@dataclass(frozen=True)
class ChoiceRules:
    """The adaptive planner's settings for one batch (its constructor's arguments)."""

    top_k: int  # full plans per batch (the current layout may take the last slot)
    screen_slack: float  # planned in full: estimates within this fraction of the best
    switch_margin: float  # a switch must gain this fraction of the current layout's time...
    switch_cost_s: float  # ...plus this
    small_batch: int  # batches of at most this many documents plan every entry in full
    move_targets: int  # stage 1b's budget
    max_moves: int | None
    use_side_plan: bool  # the leading candidate planned again, stage 1 by search
    side_plan_max_docs: int
    seed: int


@dataclass(frozen=True)
class Choice:
    """The batch's plans in full, by pool index: (time weighted by the mix factor, replicas);
    `best`: the one kept; `weight`: each entry's mix weight."""

    best: int
    plans: dict
    weight: list


def full_plan(cm, tables: dict, placement, prep: BatchPrep, counts: LayoutMix, order, bounds: list[int],
              move_targets: int, max_moves: int | None) -> list[PackedReplica]:
    """One pool entry (`counts`, placed: `placement`) planned in full: stage 1 hands out the
    documents in the estimate's `order` within its length `bounds`, stage 2 packs and prices
    each share."""
    R = len(placement)
    sync = [prep.sync(lay, R) for lay, _ in placement]
    j_of_pos = np.searchsorted(np.asarray(bounds), np.arange(prep.n), side="right").tolist() if bounds else [len(order) - 1] * prep.n
    docs = assign_documents(prep, counts, placement, sync, order, j_of_pos, move_targets, max_moves)
    return pack_and_price(cm, tables, prep, placement, docs)


def choose_plan(cm, tables: dict, placements: dict, prep: BatchPrep, layouts: list[LayoutMix],
                current: LayoutMix | None, mix_factor: float, rules: ChoiceRules, longest: int) -> Choice:
    """Steps 1-3 of the module docstring for one batch (`prep`) on the pool `layouts`
    (each placed as `placements` says), staying on `current` unless switching pays."""
    # plans that mix layouts are weighed by what mixes measured against single layouts
    weight = [mix_factor if len(c) > 1 else 1.0 for c in layouts]
    est = []
    for c, w in zip(layouts, weight):
        t, order, bounds = screen(prep, c)
        est.append((t * w, c, order, bounds))
    ranked = sorted(range(len(est)), key=lambda i: (est[i][0], i))
    t0 = est[ranked[0]][0]
    if prep.n <= rules.small_batch:
        # few documents: the fractional estimate is least reliable and full plans cheap
        ranked = [i for i in ranked if math.isfinite(est[i][0])]
        pick = ranked
        t0 = math.inf
    # plan in full the best estimates (those within the estimate's accuracy of the
    # best) and the current layout when staying on it is plausible
    if math.isfinite(t0):
        pick = [i for i in ranked[: rules.top_k] if math.isfinite(est[i][0]) and est[i][0] <= t0 * (1 + rules.screen_slack)]
    if current is not None and math.isfinite(t0):
        cur_i = layouts.index(current)
        if cur_i not in pick and est[cur_i][0] <= t0 * (1 + rules.switch_margin + rules.screen_slack):
            # staying is plausible: the current layout takes the last slot
            pick = pick[: max(1, rules.top_k - 1)] + [cur_i]
    if not pick:
        raise PlanningError(f"no candidate layout can run this batch (longest sequence {longest} tokens)")
    plans = {}
    for i in pick:
        _, c, order, bounds = est[i]
        reps = full_plan(cm, tables, placements[c], prep, c, order, bounds, rules.move_targets, rules.max_moves)
        plans[i] = (max(r.time_s for r in reps) * weight[i], reps)
    if rules.use_side_plan and prep.n <= rules.side_plan_max_docs:
        # the leading candidate again, its stage 1 by search; the plan that
        # prices lower stays
        i = min(plans, key=lambda i: (plans[i][0], i))
        alt = side_plan(cm, tables, placements[est[i][1]], prep, est[i][0] / weight[i], rules.seed)
        if alt is not None:
            t_alt = max(r.time_s for r in alt) * weight[i]
            if t_alt < plans[i][0]:
                plans[i] = (t_alt, alt)
    # the fastest; within 0.2% of it, the one with more (smaller) replicas
    t_min = min(p[0] for p in plans.values())
    nrep = lambda i: sum(c for _, c in layouts[i])  # noqa: E731
    best = min((i for i in plans if plans[i][0] <= t_min * 1.002), key=lambda i: (-nrep(i), plans[i][0], i))
    if current is not None:
        cur_i = layouts.index(current)
        if cur_i in plans and best != cur_i:
            t_cur = plans[cur_i][0]
            if plans[best][0] + rules.switch_cost_s + rules.switch_margin * t_cur >= t_cur:
                best = cur_i
    return Choice(best, plans, weight)

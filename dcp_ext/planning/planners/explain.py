"""What the planner says about its plans, in the words of the training log.

Why it exists: the log says why the layout changed between two iterations (the longest
document, where it runs, which of the old layout's replica types could not hold it) and when
the candidate pool was chosen again. Only the planner knows those reasons (its per-layout
tables), so the sentences are made here and the training loop prints what
`PlannerBase.explain` returns, reading none of the planner's insides. Pure: plans and tables in,
strings out.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from dcp_ext.planning.plan import IterationPlan


def layout_label(it: IterationPlan) -> str:
    """`tp2·pp2 + 2×tp1`: an iteration's replicas by type."""
    labels = Counter(r.replica_type.label() for r in it.replicas)
    return " + ".join(f"{n}×{lab}" if n > 1 else lab for lab, n in labels.items())


def layout_summary(it: IterationPlan) -> str:
    """`layout: tp2·pp2 + 2×tp1 | mb 3/5/5 | recompute 0/12`: the log line's layout fields."""
    mbs = "/".join(str(len(r.micro_batches)) for r in it.replicas)
    all_mbs = [mb for r in it.replicas for mb in r.micro_batches]
    recomputed = sum(1 for mb in all_mbs if mb.recompute_layers > 0)
    return f"layout: {layout_label(it)} | mb {mbs} | recompute {recomputed}/{len(all_mbs)}"


def layout_change(iteration: int, before: tuple[IterationPlan, int] | None, it: IterationPlan,
                  lengths_of: Mapping[int, int], num_layers: int, tables: Mapping) -> str | None:
    """One line when the iteration's layout differs from the last one's (`before`: that plan and
    its longest document), saying why: the longest document, where it runs and with what
    recompute, and which of the old layout's replica types could not hold it alone, or would
    recompute for it (`tables`: the planner's TypeTable per layout), or that the new layout was
    priced faster."""
    if before is None or layout_label(before[0]) == layout_label(it):
        return None
    old_it, old_longest = before
    longest = max(lengths_of.values()) if lengths_of else 0
    where = ""
    for rep in it.replicas:
        for mb in rep.micro_batches:
            if any(lengths_of.get(s) == longest for s in mb.sample_ids):
                recompute = (f"{mb.recompute_layers}/{num_layers} layers recomputed" if mb.recompute_layers
                             else "no recompute")
                where = f" on {rep.replica_type.label()}, {recompute}"
                break
        if where:
            break
    reasons = []
    for rep in {r.replica_type.layout: r for r in old_it.replicas}.values():
        table = tables.get(rep.replica_type.layout)
        if table is None:
            continue
        rs = table.rs_planned(longest)
        if rs is None:
            reasons.append(f"{rep.replica_type.label()} cannot hold it (at most {int(table.max_doc)} tokens)")
        elif rs > 0:
            reasons.append(f"{rep.replica_type.label()} would recompute {rs * rep.pp}/{num_layers} layers")
    why = "; ".join(reasons) if reasons else (f"{layout_label(old_it)} holds it without recompute: "
                                              f"{layout_label(it)} was priced faster for this batch")
    return (f"> layout change at iteration {iteration}: {layout_label(old_it)} -> {layout_label(it)} | longest "
            f"document {longest} tokens (before: {old_longest}){where} | {why}")

"""Candidate layouts: a small pool (<= 16) of ways to partition the world into replicas.

Why it exists: choosing replica types per iteration from scratch is too slow and would
need process groups for every possible layout. Like Hydraulis, we decide once per run,
from the dataset's length histogram, which heterogeneous layouts are worth having; each
iteration then only picks among them (`dcp_ext.planning.planners.adaptive`).

How: (1) for batches drawn from the histogram (typical ones, plus batches of only its
short half and only its long tail), a dynamic program over every replica type the
cluster allows (longest documents to the types that finish them fastest, contiguous
length ranges of documents per type, bisection on the iteration time; run twice so the
parameter sync matches the replica count found) gives the layout each batch wants;
(2) from those layouts a greedy cover keeps the few that together serve the sample
batches best (relative to each batch's lower bound), plus any that is the best for some
batch, plus one that can hold a max-length sequence. (`prune_types` can first thin the
types to the Pareto-optimal ones for large clusters.)

The per-batch tables and the water-filling estimate (`screen`) that ranks layouts live in
`dcp_ext.planning.planners.batch_prep`; the per-iteration planner uses them too.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dcp_ext.kernels import kernel
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout, LayoutMix
from dcp_ext.planning.planners.batch_prep import BatchPrep, TypeOnBatch, screen, type_order
from dcp_ext.planning.layout import canonical
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.tables import TypeTable, doc_costs, pipeline_capacity

BIG = 1e30


# ---------------------------------------------------------------------------- type pruning
def prune_types(cm: CostModel, tables: dict[Layout, TypeTable], lengths: np.ndarray, t_ref: float, keep: int = 14) -> list[Layout]:
    """Layouts that are Pareto-optimal in (effective device-seconds, alone time) for some
    length of the sample's range, the smallest layouts (to fill leftover devices), and the
    fastest holder of the longest length."""
    qs = [0.05, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0]
    grid = np.unique(np.quantile(lengths, qs).round().astype(np.int64))
    grid = grid[grid > 0]
    votes: dict[Layout, int] = {}
    layouts = list(tables)
    eff = np.full((len(layouts), len(grid)), np.inf)
    alone = np.full((len(layouts), len(grid)), np.inf)
    for j, lay in enumerate(layouts):
        tt = tables[lay]
        dc = doc_costs(cm, tt, grid)
        sync = cm.sync_time(lay, None)
        frac = max(1e-3, 1.0 - sync / t_ref) if t_ref > 0 else 1.0
        eff[j] = lay.size * dc.cost / frac
        alone[j] = dc.alone + sync
    for g in range(len(grid)):
        pts = [(eff[j, g], alone[j, g], j) for j in range(len(layouts)) if np.isfinite(eff[j, g])]
        pts.sort()
        best_alone = math.inf
        for e, a, j in pts:
            if a < best_alone - 1e-12:
                best_alone = a
                # only layouts that can finish the document within a plausible iteration
                if a <= 1.5 * t_ref or a == min(p[1] for p in pts):
                    votes[layouts[j]] = votes.get(layouts[j], 0) + 1
    chosen = sorted(votes, key=lambda l: (-votes[l], l.size))[:keep]
    # smallest layouts that fit, so leftover devices can always be used
    min_size = min(l.size for l in layouts)
    small = [l for l in layouts if l.size == min_size]
    small.sort(key=lambda l: eff[layouts.index(l)][np.isfinite(eff[layouts.index(l)])].mean() if np.isfinite(eff[layouts.index(l)]).any() else math.inf)
    if small and small[0] not in chosen:
        chosen.append(small[0])
    return chosen


# ---------------------------------------------------------------------------- dynamic program per batch
def _bins(prep: BatchPrep, ref: TypeOnBatch, singles: int = 16, groups: int = 48) -> np.ndarray:
    n = prep.n
    head = min(n, singles)
    b = list(range(head + 1))
    if n > head:
        c = np.where(np.isfinite(ref.cost[head:]), ref.cost[head:], 0.0) + 1e-12
        cs = np.cumsum(c)
        targets = np.linspace(0, cs[-1], groups + 1)[1:-1]
        idx = head + 1 + np.searchsorted(cs, targets, side="left")
        b.extend(int(i) for i in idx)
        b.append(n)
    return np.unique(np.asarray(b, dtype=np.int64))


def best_mix_by_dynamic_program(prep: BatchPrep, layouts: Sequence[Layout], world: int, lo: float,
                                rel_tol: float = 5e-3, num_replicas: int | None = None) -> tuple[LayoutMix, float]:
    """The layout mix (replicas per type) this batch wants, by bisection on the iteration
    time with a dynamic program over types (in order) and contiguous document ranges (bins)."""
    order = type_order(prep, layouts)
    order = [l for l in order if prep.types[l].first_ok < prep.n or prep.n == 0]
    if not order:
        raise PlanningError("no layout can hold any document of this batch")
    ref = min((prep.types[l] for l in order), key=lambda t: t.tt.size * float(np.nanmean(np.where(np.isfinite(t.cost), t.cost, np.nan))) if np.isfinite(t.cost).any() else math.inf)
    B = _bins(prep, ref)
    nb = len(B) - 1
    tri = np.triu(np.ones((nb + 1, nb + 1), dtype=bool), 1)

    dp = kernel("mix_dynamic_program")
    if dp is not None and prep.n:
        counts = _mix_by_kernel(dp, prep, order, B, world, lo, rel_tol, num_replicas)
        return canonical(counts[0]), counts[1]

    def solve(T: float):
        f_next = np.full(nb + 1, np.inf)
        f_next[nb] = 0.0
        choices = []
        for lay in reversed(order):
            t = prep.types[lay]
            sync = prep.sync(lay, num_replicas)
            w = pipeline_capacity(T - sync, lay.pp, t.c0, t.tt.mb_full)
            cumB = t.cum[B]
            start = B[:-1]
            ok_start = np.zeros(nb + 1, dtype=bool)
            ok_start[:-1] = (start >= t.first_ok) & (t.alone[np.minimum(start, prep.n - 1)] + sync <= T)
            if w <= 0:
                f = f_next.copy()
                choices.append((lay, np.arange(nb + 1), np.zeros(nb + 1)))
                f_next = f
                continue
            diff = cumB[None, :] - cumB[:, None]
            if lay.pp > 1:  # bubble of the range's longest document
                first = t.cost[np.minimum(B, prep.n - 1)]
                diff = diff + (lay.pp - 1) * np.where(np.isfinite(first), first, BIG)[:, None]
            q = np.ceil(diff / w - 1e-12)
            q = np.maximum(q, 1.0)
            gpus = q * lay.size + f_next[None, :]
            valid = tri & ok_start[:, None] & (q <= world // lay.size)
            gpus = np.where(valid, gpus, np.inf)
            stay = f_next.copy()  # take nothing
            best_e = np.argmin(gpus, axis=1)
            best = gpus[np.arange(nb + 1), best_e]
            use = best < stay
            f = np.where(use, best, stay)
            e_choice = np.where(use, best_e, np.arange(nb + 1))
            q_choice = np.where(use, q[np.arange(nb + 1), best_e], 0)
            choices.append((lay, e_choice, q_choice))
            f_next = f
        return f_next[0], list(reversed(choices))

    hi = max(lo, 1e-9)
    for _ in range(60):
        need, ch = solve(hi)
        if need <= world:
            break
        lo, hi = hi, hi * 1.25
    else:
        raise PlanningError("no layout found for a batch (the dynamic program diverged)")
    for _ in range(40):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if solve(mid)[0] <= world:
            hi = mid
        else:
            lo = mid
    _, ch = solve(hi)
    counts: dict[Layout, int] = {}
    i = 0
    for lay, e_choice, q_choice in ch:
        q = int(q_choice[i])
        if q > 0:
            counts[lay] = counts.get(lay, 0) + q
        i = int(e_choice[i])
    return canonical(counts), hi


def _mix_by_kernel(dp, prep: BatchPrep, order: list[Layout], B: np.ndarray, world: int, lo: float, rel_tol: float,
                   num_replicas: int | None) -> tuple[dict, float]:
    """best_mix_by_dynamic_program's bisection and dynamic program by the kernel, from the
    same per-type tables: (replicas per type, the time it reached)."""
    types = [prep.types[l] for l in order]
    start = np.minimum(B[:-1], prep.n - 1)
    first = [t.cost[np.minimum(B, prep.n - 1)] for t in types]
    counts, hi = dp(np.stack([t.cum[B] for t in types]), np.stack([t.alone[start] for t in types]),
                        np.stack([np.where(np.isfinite(f), f, BIG) for f in first]),
                        np.stack([B[:-1] >= t.first_ok for t in types]).astype(np.uint8),
                        np.array([prep.sync(l, num_replicas) for l in order], dtype=float),
                        np.array([l.pp for l in order], dtype=np.int64), np.array([t.c0 for t in types], dtype=float),
                        np.array([t.tt.mb_full for t in types], dtype=float),
                        np.array([l.size for l in order], dtype=np.int64), int(world), float(lo), float(rel_tol))
    if counts is None:
        raise PlanningError("no layout found for a batch (the dynamic program diverged)")
    return {l: int(q) for l, q in zip(order, counts) if q > 0}, float(hi)


def fill_leftover(prep: BatchPrep, counts: LayoutMix, options: Sequence[Layout], world: int) -> LayoutMix:
    """Give unused devices to the type whose extra replica helps this batch most."""
    used = sum(l.size * c for l, c in counts)
    cur = dict(counts)
    while used < world:
        left = world - used
        best = None
        for lay in options:
            if lay.size > left:
                continue
            trial = dict(cur)
            trial[lay] = trial.get(lay, 0) + 1
            t = screen(prep, canonical(trial))[0]
            key = (t, -lay.size)
            if best is None or key < best[0]:
                best = (key, lay)
        if best is None:
            raise PlanningError(f"{left} devices left that no layout can use")
        cur[best[1]] = cur.get(best[1], 0) + 1
        used += best[1].size
    return canonical(cur)


# ---------------------------------------------------------------------------- the pool
@dataclass
class Pool:
    layouts: list[LayoutMix]
    types: list[Layout]  # types the dynamic program considered (pruned)
    sample_times: np.ndarray  # [layouts, sample batches] screening estimates
    considered: list[LayoutMix]  # the mixes the cover chose from (the dynamic program's, one-type holders)


def build_pool(
    cm: CostModel,
    tables: dict[Layout, TypeTable],
    batches: Sequence[np.ndarray],
    max_seq_len: int,
    max_layouts: int = 16,
    progress: Callable[[int, int], None] | None = None,
    prune: bool = False,
    extra_batches: Sequence[np.ndarray] = (),
    extra_weight: float = 0.25,
    exact: Callable[[BatchPrep, LayoutMix], float] | None = None,
    shortlist: int = 3,
    refine: bool = True,
) -> Pool:
    """Pick <= max_layouts layouts for the run (see the module docstring).

    `extra_batches` (e.g. only short or only long documents of the histogram) widen the
    pool towards batches that are rarer than the typical ones; they count with
    `extra_weight` in the cover. Layouts of one replica type throughout (those that can
    hold a max-length sequence) are candidates too. With `exact` (the planner's full
    plan, priced), the cover uses exact times of each batch's `shortlist` best layouts by
    the estimate: the estimate is fractional and flatters layouts whose few documents
    cannot be balanced over their replicas. `refine=False` takes each batch's weaker lower
    bound (`lower_bound`'s, without its longest-document refinement): half the time, for
    a pool chosen again while training."""
    from dcp_ext.planning.bound import bound_tables, lower_bound

    terms: dict = {}  # per-layout terms of the bound, shared by every batch

    def bound(b):
        return lower_bound(cm, b, tables=bound_tables(cm, b, list(tables), terms) if len(b) else None, refine=refine)

    world = cm.cluster.num_gpus
    all_lens = np.concatenate([np.asarray(b) for b in batches]) if batches else np.array([max_seq_len])
    holders = [l for l, t in tables.items() if t.max_doc >= max_seq_len]
    if not holders:
        best = max(tables.values(), key=lambda t: t.max_doc) if tables else None
        longest = int(best.max_doc) if best else 0
        raise PlanningError(
            f"a sequence of {max_seq_len} tokens fits no layout of {cm.cluster.name} for {cm.model.name}; "
            f"the longest that fits is {longest} tokens" + (f" ({best.layout})" if best else "")
        )
    lbs = []
    preps = []
    for b in batches:
        preps.append(BatchPrep(cm, tables, b))
        lbs.append(bound(b))
    t_ref = float(np.median(lbs)) if lbs else 1.0
    types = prune_types(cm, tables, np.append(all_lens, max_seq_len), t_ref) if prune else list(tables)
    # the max-length holder that finishes it fastest must be available
    fastest_holder = min(holders, key=lambda l: (doc_costs(cm, tables[l], np.array([max_seq_len])).alone[0] + cm.sync_time(l, None), -l.size))
    if fastest_holder not in types:
        types.append(fastest_holder)
    found: list[LayoutMix] = []
    synth = np.append(batches[0], max_seq_len) if batches else np.array([max_seq_len])
    extras = [np.asarray(b) for b in extra_batches if len(b)]
    for b in extras:
        preps.append(BatchPrep(cm, tables, b))
        lbs.append(bound(b))
    weights = np.array([1.0] * (len(preps) - len(extras)) + [extra_weight] * len(extras))
    jobs = list(zip(preps, lbs)) + [(BatchPrep(cm, tables, synth), bound(synth))]
    for k, (prep, lb) in enumerate(jobs):
        counts, _ = best_mix_by_dynamic_program(prep, types, world, lb)
        # again with the sync of as many replicas as that layout has (each device also
        # sends its shard to every replica)
        counts2, _ = best_mix_by_dynamic_program(prep, types, world, lb, num_replicas=sum(c for _, c in counts))
        if screen(prep, counts2)[0] < screen(prep, counts)[0]:
            counts = counts2
        counts = fill_leftover(prep, counts, types, world)
        if counts not in found:
            found.append(counts)
        if progress:
            progress(k + 1, len(jobs))
    cover = found[-1] if len(jobs) > len(preps) else None
    for lay in sorted(holders, key=lambda l: (-l.size, l)):
        uni = canonical({lay: world // lay.size})
        if uni not in found:
            found.append(uni)
    times = np.array([[screen(p, c)[0] for p in preps] for c in found]) if preps else np.zeros((len(found), 0))
    if exact is not None and preps:
        # exact prices for each batch's shortlist; the rest stay out of reach
        est_times = times
        times = np.full_like(est_times, np.inf)
        for b, prep in enumerate(preps):
            order = np.argsort(est_times[:, b], kind="stable")[:shortlist]
            for i in order:
                if np.isfinite(est_times[i, b]):
                    times[i, b] = exact(prep, found[i])
    # relative to each batch's own lower bound, so long and short batches weigh alike
    rel = times / np.maximum(np.asarray(lbs), 1e-12)[None, :] * weights[None, :] if preps else times
    chosen: list[int] = []
    best = np.full(rel.shape[1], np.inf)
    while len(chosen) < min(max_layouts, len(found)):
        scores = [np.minimum(best, rel[i]).sum() if i not in chosen else np.inf for i in range(len(found))]
        i = int(np.argmin(scores))
        if not np.isfinite(scores[i]) and chosen:
            break
        gain = best.sum() - scores[i] if np.isfinite(best).all() else np.inf
        if chosen and gain <= 1e-4 * best.sum():
            break
        chosen.append(i)
        best = np.minimum(best, rel[i])
    # layouts that are the best for some batch (ties go to more, smaller replicas) join too
    if len(found) and rel.shape[1]:
        nrep = np.array([sum(c for _, c in f) for f in found])
        for b in range(rel.shape[1]):
            col = rel[:, b]
            tied = np.nonzero(col <= col.min() * (1 + 1e-3))[0]
            i = int(max(tied, key=lambda i: (nrep[i], -i)))
            if i not in chosen and len(chosen) < max_layouts:
                chosen.append(i)
    pool = [found[i] for i in chosen]
    if cover is not None and not any(any(tables[l].max_doc >= max_seq_len for l, _ in c) for c in pool):
        if len(pool) >= max_layouts:
            pool[-1] = cover
        else:
            pool.append(cover)
    sel = [found.index(c) for c in pool]
    return Pool(pool, types, times[sel] if len(times) else times, found)


def stderr_progress(desc: str, interval_s: float = 5.0) -> Callable[[int, int], None]:
    """A progress callback on stderr: one redrawn line on a terminal; in a log (not a TTY) a
    plain line at most every `interval_s` seconds and at the end, so lines never run together."""
    import time

    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    last = [-float("inf")]

    def cb(k: int, n: int) -> None:
        width = 24
        done = int(width * k / max(n, 1))
        line = f"{desc}: [{'#' * done}{'-' * (width - done)}] {k}/{n}"
        if tty:
            sys.stderr.write("\r" + line + ("\n" if k >= n else ""))
        elif k >= n or time.monotonic() - last[0] >= interval_s:
            last[0] = time.monotonic()
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    return cb


def with_static_entry(pool: Pool, entry: LayoutMix, tables: dict, max_seq_len: int, max_layouts: int) -> Pool:
    """`pool` with the static layout's `entry` first, displacing the last entry the search
    chose when the pool is full, never the last one that holds a max-length sequence."""
    others = [c for c in pool.layouts if c != entry]

    def holds(c):
        return any(tables[l].max_doc >= max_seq_len for l, _ in c if l in tables)

    while len(others) + 1 > max(1, max_layouts):
        drop = next((i for i in range(len(others) - 1, -1, -1)
                     if not holds(others[i]) or holds(entry) or sum(holds(c) for c in others) > 1), None)
        others.pop(len(others) - 1 if drop is None else drop)
    return Pool([entry] + others, pool.types, np.zeros((len(others) + 1, 0)), pool.considered)


def reserve_layouts(cm: CostModel, considered: Sequence[LayoutMix], used: list[Layout], tables: dict, max_layouts: int,
                    uneven_stages: bool) -> list[Layout]:
    """The layouts a re-chosen pool may use: the pool's (`used`), then those of the mixes the
    search `considered` (each batch's best, the one-type holders), at most `max_layouts`,
    none with a larger stage than the pool's (the shared buffers do not grow); with
    `uneven_stages`, no pipelined layout whose split was not chosen with the pool's."""
    model = cm.model
    largest = max(model.local_stage_params(l.tp, l.pp) for l in used)
    out = list(used)
    for c in considered:
        for l, _ in c:
            if len(out) >= max(max_layouts, len(used)):
                return out
            if l in out or l not in tables or model.local_stage_params(l.tp, l.pp) > largest:
                continue
            if l.pp > 1 and uneven_stages and l not in cm.stage_splits and not cm.quadratic(l):
                continue
            out.append(l)
    return out

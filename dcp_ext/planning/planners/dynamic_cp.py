"""Baselines with per-sequence context parallelism: `dynamic-cp` (upstream Megatron) and `cp-buckets`.

Why they exist: they are the closest published alternatives to the adaptive planner, so
its advantage has to be shown against them on the same batches and the same cost model.

`dynamic-cp` follows upstream Megatron's hybrid/dynamic context parallelism
(BalancedCPScheduler): TP and PP fixed for the run; the data-parallel x context-parallel
ranks form one pool; a sequence of s tokens gets cp = next power of two of
ceil(s / max_seq_len_per_rank); groups are formed longest sequence first (a new group of
exactly that size while free ranks remain, else the least loaded existing group that is
large enough), balanced by the workload estimate s^2 / cp that upstream uses; each group
packs its sequences into micro-batches of at most cp * max_seq_len_per_rank tokens.
Upstream re-forms groups for each micro-batch; a dcp-plan/v1 iteration fixes its replicas,
so here one grouping serves the whole iteration (longer sequences are never put on a
group smaller than they need; shorter ones may share a larger group).

`cp-buckets` (NUS DCP's scheme, named for what it does: context parallelism per length bucket,
gradient accumulation to balance): TP fixed, pp = 1; sequences bucketed by the same cp
rule; each bucket gets devices in proportion to its predicted work (by the cost model),
split into groups of its cp; longest-processing-time balancing with the cost model inside
a bucket; every group accumulates over as many micro-batches as its share needs.

Both choose their fixed settings (tp, pp, recompute none/full, max_seq_len_per_rank) by
the same cost-model search on histogram batches as `static`.

Where memory is quadratic in document lengths (CPU attention) tokens per rank do not say
what fits: a sequence's cp is also at least the least one that holds it (`cp_needed`),
and micro-batches are packed within memory by their documents.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import next_pow2
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.planning.planners.base import PlannerBase
from dcp_ext.planning.batching import sample_batches
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import finish_replica, first_fit_decreasing, to_iteration_plan
from dcp_ext.planning.planners.tables import make_type_table
from dcp_ext.planning.planners.doc_memory import bin_check


class _CPPoolPlanner(PlannerBase):
    """Shared: fixed (tp, pp, recompute), a pool of D = N / (tp*pp) ranks split into CP groups."""

    allow_pp = True

    def __init__(self, model, cluster, max_seq_len, global_batch_tokens, length_sample=None, profile=None,
                 memory_margin=0.1, seed=0, progress=False, *, sample_count: int = 8,
                 setting: tuple[int, ...] | None = None):
        super().__init__(model, cluster, max_seq_len, global_batch_tokens, length_sample, profile, memory_margin, seed, progress)
        self._tables: dict[Layout, object] = {}
        self._doc_caps: dict[tuple[int, int, int, int], int] = {}
        if setting is not None and len(setting) == 3:
            setting = (*setting, int(self._per_rank(*setting)))
        cands = self._settings() if setting is None else [tuple(setting)]
        if not cands:
            raise PlanningError(f"{self.name}: no (tp, pp, recompute) of {model.name} on {cluster.name} can hold {max_seq_len} tokens")
        self.search: list[tuple[float, tuple[int, int, int, int]]] = []
        if len(cands) == 1:
            self.tp, self.pp, self.rs, self.per_rank = cands[0]
        else:
            batches = sample_batches(self.length_sample, self.global_batch_tokens, self.max_seq_len, sample_count, seed)

            def score(st, bs):
                self.tp, self.pp, self.rs, self.per_rank = st
                try:
                    return float(np.mean([self._plan(np.asarray(b))[0] for b in bs]))
                except PlanningError:
                    return math.inf

            # a quick pass on a few batches, then the best few on all of them
            quick = sorted((score(st, batches[:2]), st) for st in cands)
            for _, st in quick[:6]:
                t = score(st, batches)
                if math.isfinite(t):
                    self.search.append((t, st))
            if not self.search:
                raise PlanningError(f"{self.name}: no setting can run the sample batches")
            self.search.sort()
            self.tp, self.pp, self.rs, self.per_rank = self.search[0][1]
        D = self.pool_size
        unit = self.tp * self.pp
        c = 1
        while c <= D:
            lay = Layout(self.tp, c, self.pp)
            self._register([(lay, range(start, start + c * unit)) for start in range(0, cluster.num_gpus, c * unit)])
            c *= 2

    @property
    def pool_size(self) -> int:
        return self.cluster.num_gpus // (self.tp * self.pp)

    def describe(self) -> str:
        return (f"{self.name}: tp{self.tp} pp{self.pp}, recompute {self.rs * self.pp} layers, "
                f"max {int(self.per_rank)} tokens per rank")

    # ------------------------------------------------------------------ settings
    def _per_rank(self, tp: int, pp: int, rs: int) -> float:
        """Tokens one rank of the pool holds (pp micro-batches in flight)."""
        return self.cm.max_tokens(Layout(tp, 1, pp), rs, pp)

    def _settings(self) -> list[tuple[int, int, int, int]]:
        """(tp, pp, recompute per stage, max tokens per rank): recompute none or full (a
        run-wide flag upstream), and max_seq_len_per_rank from what memory allows down to
        1/32 of it (a smaller value gives long sequences more CP ranks)."""
        out = []
        n = self.cluster.num_gpus
        for lay in self.cm.all_layouts():
            if lay.cp != 1 or (lay.pp > 1 and not self.allow_pp):
                continue
            Ls = self.cm.layers_per_stage(lay)
            for rs in sorted({0, Ls}):
                mem = self._per_rank(lay.tp, lay.pp, rs)
                if mem < 1:
                    continue
                for k in range(6):
                    per = int(mem / 2**k)
                    if per < 1024 and k > 0:
                        break
                    need = self._cp_for(lay.tp, lay.pp, rs, per, self.max_seq_len, n // lay.size)
                    if need * lay.size <= n:
                        out.append((lay.tp, lay.pp, rs, per))
        return out

    def table(self, lay: Layout):
        t = self._tables.get(lay)
        if t is None:
            t = make_type_table(self.cm, lay, "any")
            self._tables[lay] = t
        return t

    def cp_needed(self, s: float) -> int:
        return self._cp_for(self.tp, self.pp, self.rs, self.per_rank, s, self.pool_size)

    def _cp_for(self, tp: int, pp: int, rs: int, per_rank: float, s: float, ranks: int) -> int:
        """Upstream's rule, next power of two of ceil(s / per_rank); on quadratic layouts
        raised to the least cp (up to `ranks`, else twice that) whose replica holds the
        document alone at rs, pp like it in flight."""
        cp = next_pow2(math.ceil(s / per_rank))
        while self.cm.quadratic(Layout(tp, cp, pp)) and cp <= ranks and s > self._doc_cap(tp, cp, pp, rs):
            cp *= 2
        return cp

    def _doc_cap(self, tp: int, cp: int, pp: int, rs: int) -> int:
        key = (tp, cp, pp, rs)
        if key not in self._doc_caps:
            self._doc_caps[key] = self.cm.max_doc_length(Layout(tp, cp, pp), rs, pp)
        return self._doc_caps[key]

    # ------------------------------------------------------------------ per iteration
    def plan_iteration(self, index: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        s = self._check_input(sample_ids, lengths)
        _, reps = self._plan(s)
        return to_iteration_plan(index, sample_ids, reps, self.cm)

    def _plan(self, s: np.ndarray):
        groups = self._groups(s)  # list of (cp, [doc positions])
        groups.sort(key=lambda g: -g[0])
        unit = self.tp * self.pp
        reps = []
        start = 0
        R = len(groups)
        for cp, docs in groups:
            lay = Layout(self.tp, cp, self.pp)
            tt = self.table(lay)
            cap = cp * self.per_rank
            check = bin_check(self.cm, lay, s, self.rs, tt.allowed_rs[-1])
            mbs = [(b, self.rs) for b in first_fit_decreasing(docs, s, cap, check)] if docs else []
            ranks = list(range(start, start + cp * unit))
            start += cp * unit
            reps.append(finish_replica(self.cm, tt, ranks, s, mbs, R))
        if start != self.cluster.num_gpus:  # pragma: no cover
            raise PlanningError(f"{self.name}: groups use {start} of {self.cluster.num_gpus} devices")
        return max(r.time_s for r in reps), reps

    def _groups(self, s: np.ndarray) -> list[tuple[int, list[int]]]:
        raise NotImplementedError


class DynamicCPPlanner(_CPPoolPlanner):
    name = "dynamic-cp"

    def _groups(self, s: np.ndarray) -> list[tuple[int, list[int]]]:
        D = self.pool_size
        order = np.argsort(-s, kind="stable")
        sizes: list[int] = []
        docs: list[list[int]] = []
        load: list[float] = []
        free = D
        for p in order:
            x = float(s[p])
            need = self.cp_needed(x)
            if need > D:
                raise PlanningError(f"{self.name}: a sequence of {int(x)} tokens needs cp {need} > {D} ranks")
            best, best_load = -1, math.inf
            for g, c in enumerate(sizes):
                if c >= need and load[g] < best_load:
                    best, best_load = g, load[g]
            if free >= need and (best < 0 or best_load > 0.0):
                sizes.append(need)
                docs.append([int(p)])
                load.append(x * x / need)
                free -= need
                continue
            if best < 0:
                raise PlanningError(f"{self.name}: no group can take a sequence of {int(x)} tokens")
            docs[best].append(int(p))
            load[best] += x * x / sizes[best]
        # ranks still free (fewer sequences than ranks): grow the smallest groups (upstream
        # raises the cp of a sample until no rank is idle)
        while free > 0:
            g = min(range(len(sizes)), key=lambda g: (sizes[g], -load[g]))
            if sizes[g] > free:
                sizes.append(1)
                docs.append([])
                load.append(0.0)
                free -= 1
                continue
            free -= sizes[g]
            sizes[g] *= 2
        return list(zip(sizes, docs))


class CPBucketsPlanner(_CPPoolPlanner):
    name = "cp-buckets"
    allow_pp = False

    def _groups(self, s: np.ndarray) -> list[tuple[int, list[int]]]:
        D = self.pool_size
        need = np.array([self.cp_needed(float(x)) for x in s], dtype=np.int64) if len(s) else np.zeros(0, dtype=np.int64)
        if len(s) and need.max() > D:
            raise PlanningError(f"{self.name}: a sequence of {int(s.max())} tokens needs cp {int(need.max())} > {D} ranks")
        buckets = sorted(set(need.tolist()), reverse=True)
        cost = {}
        work = {}
        for c in buckets:
            lay = Layout(self.tp, c, self.pp)
            co = self.cm.coeffs(lay, self.rs)
            sel = np.nonzero(need == c)[0]
            v = s[sel].astype(float)
            cst = co.a * v * v + co.b * v + co.c
            cost[c] = dict(zip(sel.tolist(), cst.tolist()))
            work[c] = float(cst.sum()) * c  # ranks x seconds
        # ranks per bucket in proportion to work, whole groups, at least one each
        groups_n = {c: 1 for c in buckets}
        used = sum(buckets)
        if used > D:
            raise PlanningError(f"{self.name}: buckets {buckets} need more than {D} ranks")
        while True:
            # the bucket with the highest work per rank gets one more group if it fits
            cand = [c for c in buckets if used + c <= D]
            if not cand:
                break
            c = max(cand, key=lambda c: (work[c] / (groups_n[c] * c), c))
            groups_n[c] += 1
            used += c
        out: list[tuple[int, list[int]]] = []
        for c in buckets:
            k = groups_n[c]
            heap = [(0.0, g) for g in range(k)]
            members: list[list[int]] = [[] for _ in range(k)]
            for p in sorted(cost[c], key=lambda p: -cost[c][p]):
                l, g = heapq.heappop(heap)
                members[g].append(p)
                heapq.heappush(heap, (l + cost[c][p], g))
            out.extend((c, m) for m in members)
        left = D - used
        out.extend((1, []) for _ in range(left))
        return out

"""The `static` baseline: upstream Megatron as a careful user would run it.

Why it exists: a speedup is only worth reporting against a strong baseline. This one gets
the best single (tp, cp, pp, recompute) for the run, searched with the same cost model on
batches drawn from the same length histogram the adaptive planner sees; documents are
packed first-fit-decreasing into packs of at most max_seq_len tokens (Megatron's
--seq-length, THD with document-masked attention: cost sum s^2, never pack length^2);
packs are dealt round-robin to the data-parallel replicas, so every replica runs the
same number of micro-batches (one more for some when the count does not divide). The
recompute is the least that lets a full pack (and, with pipelines, pp of them in flight)
fit. Where memory is quadratic in document lengths (CPU attention) "a full pack" is a
document of max_seq_len tokens, and packs are also kept within memory (see `_packs`).

`balance=True` (what `--dcp --dcp-planner static` trains with): the same layout and
recompute, but the replicas get equal work, not only equal pack counts (`_balanced`).
First-fit-decreasing fills the first packs with the longest documents, and a batch that
needs one pack more than a multiple of the replicas gives one replica twice the work:
measured on 4 CPU ranks, the others then wait 40-50% of the iteration.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.planning.planners.base import PlannerBase
from dcp_ext.planning.batching import sample_batches
from dcp_ext.planning.layout import place
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica, first_fit_decreasing, to_iteration_plan
from dcp_ext.planning.planners.doc_memory import bin_check
from dcp_ext.planning.simulator import one_f_one_b


class StaticPlanner(PlannerBase):
    name = "static"

    def __init__(self, model, cluster, max_seq_len, global_batch_tokens, length_sample=None, profile=None,
                 memory_margin=0.1, seed=0, progress=False, *, layout: tuple[int, int, int] | None = None,
                 recompute_layers: int | None = None, sample_count: int = 16, balance: bool = False):
        super().__init__(model, cluster, max_seq_len, global_batch_tokens, length_sample, profile, memory_margin, seed, progress)
        self.balance = bool(balance)
        cands = self._candidates()
        if layout is not None:
            lay = Layout(*layout)
            rs = self._min_rs(lay) if recompute_layers is None else self.cm.stage_recompute(lay, recompute_layers)
            if rs is not None and self.cm.quadratic(lay) and not self._holds(lay, rs):
                rs = None
            if rs is None:
                raise PlanningError(f"{lay} cannot hold a pack of {self.max_seq_len} tokens"
                                    + (" at that recompute" if recompute_layers is not None else ""))
            cands = [(lay, rs)]
        if not cands:
            raise PlanningError(
                f"no single layout of {model.name} on {cluster.name} holds a pack of {self.max_seq_len} tokens"
            )
        self.search: list[tuple[float, Layout, int]] = []
        if len(cands) == 1:
            self.layout, self.rs = cands[0]
        else:
            batches = sample_batches(self.length_sample, self.global_batch_tokens, self.max_seq_len, sample_count, seed)
            packed = [self._packs(np.asarray(b)) for b in batches]
            for lay, rs in cands:
                packs = [self._packs(np.asarray(b), lay, rs) for b in batches] if self.cm.quadratic(lay) else packed
                t = float(np.mean([self._time(lay, rs, np.asarray(b), pk)[0] for b, pk in zip(batches, packs)]))
                self.search.append((t, lay, rs))
            self.search.sort(key=lambda x: (x[0], x[1].size))
            _, self.layout, self.rs = self.search[0]
        self.replicas = place([self.layout] * (cluster.num_gpus // self.layout.size), cluster.num_gpus)
        self._register(self.replicas)

    def describe(self) -> str:
        return f"static: {self.layout} x{len(self.replicas)}, recompute {self.cm.recompute_layers(self.layout, self.rs)} layers"

    # ------------------------------------------------------------------ search
    def _min_rs(self, lay: Layout) -> int | None:
        inflight = lay.pp
        for rs in range(self.cm.layers_per_stage(lay) + 1):
            if self.cm.max_tokens(lay, rs, inflight) >= self.max_seq_len and (
                    not self.cm.quadratic(lay) or self._holds(lay, rs)):
                return rs
        return None

    def _holds_longest(self) -> bool:
        lay, rs = self.layout, self.rs
        return self.cm.max_tokens(lay, rs, lay.pp) >= self.max_seq_len and (
            not self.cm.quadratic(lay) or self._holds(lay, rs))

    def _holds(self, lay: Layout, rs: int) -> bool:
        """Quadratic memory: a max_seq_len document fits at rs, pp of them in flight."""
        return self.cm.max_doc_length(lay, rs, lay.pp) >= self.max_seq_len

    def _candidates(self) -> list[tuple[Layout, int]]:
        out = []
        for lay in self.cm.all_layouts():
            rs = self._min_rs(lay)
            if rs is not None:
                out.append((lay, rs))
        return out

    def _packs(self, s: np.ndarray, lay: Layout | None = None, rs: int = 0) -> list[list[int]]:
        """Packs of at most max_seq_len tokens, first-fit-decreasing. On a quadratic layout
        (`lay`) also by their documents' memory at `rs`, that level throughout (BinCheck with
        top = rs): then every 1F1B window of packs fits as it is. A document alone always
        fits: `_holds` made pp of a max_seq_len one fit in flight."""
        check = bin_check(self.cm, lay, s, rs, rs) if lay is not None else None
        return first_fit_decreasing(range(len(s)), s, self.max_seq_len, check)

    def _balanced(self, s: np.ndarray, packs: list[list[int]]) -> list[list[int]]:
        """The documents again in k·d packs (d replicas; k the fewest that first-fit-decreasing
        allows, or one more), each document, costliest first by the cost model's (calibrated)
        prices, into the cheapest pack with room (tokens, and memory on quadratic layouts);
        then dealt so that each replica gets k packs and as equal a cost as the greedy
        finds. Ordered for `_deal`'s round robin. The first-fit-decreasing packs when
        nothing better fits, or when it balances no worse."""
        lay, rs = self.layout, self.rs
        d = self.cluster.num_gpus // lay.size
        co = self.cm.coeffs(lay, rs)
        x = s.astype(float)
        one = co.mb_time(x * x, x, np.ones_like(x)) - co.mb_time(0.0, 0.0, 0)  # each document alone, less the constant
        order = sorted(range(len(s)), key=lambda i: (-one[i], i))
        k0 = -(-len(packs) // d)
        best = (self._imbalance(s, self._deal(packs, d)), packs)
        for k in (k0, k0 + 1):
            n = k * d
            if n > len(s):
                break
            check = bin_check(self.cm, lay, s, rs, rs) if self.cm.quadratic(lay) else None
            bins: list[list[int]] = [[] for _ in range(n)]
            load, room = [0.0] * n, [float(self.max_seq_len)] * n
            for i in order:
                fit = [b for b in range(n) if s[i] <= room[b] and (check is None or check.fits(b, bins[b] + [i]))]
                if not fit:
                    break
                b = min(fit, key=lambda b: (load[b], b))
                bins[b].append(i)
                load[b] += one[i]
                room[b] -= s[i]
                if check is not None:
                    check.put(b, bins[b])
            else:
                if any(not b for b in bins):
                    continue
                # deal: costliest pack first to the replica with the least work and a free slot
                per: list[list[list[int]]] = [[] for _ in range(d)]
                work = [0.0] * d
                for b in sorted(range(n), key=lambda b: (-load[b], b)):
                    r = min((r for r in range(d) if len(per[r]) < k), key=lambda r: (work[r], r))
                    per[r].append(bins[b])
                    work[r] += load[b]
                dealt = [per[r][j] for j in range(k) for r in range(d)]  # round robin gives per[r] back
                score = self._imbalance(s, per)
                if score < best[0]:
                    best = (score, dealt)
        return best[1]

    def _imbalance(self, s: np.ndarray, per: list[list[list[int]]]) -> float:
        """The slowest replica's predicted time for this deal."""
        co = self.cm.coeffs(self.layout, self.rs)
        return max((self._pipeline(co, self.layout, s, mbs) for mbs in per if mbs), default=0.0)

    @staticmethod
    def _pipeline(co, lay: Layout, s: np.ndarray, mbs: list[list[int]]) -> float:
        """1F1B makespan of one replica's packs."""
        fwd, bwd = [], []
        for p in mbs:
            v = s[p].astype(float)
            f, b = co.mb_fwd_bwd(float(v @ v), float(v.sum()), len(p))
            fwd.append(f)
            bwd.append(b)
        return one_f_one_b(fwd, bwd, lay.pp).makespan

    def _deal(self, packs: list[list[int]], d: int) -> list[list[list[int]]]:
        per: list[list[list[int]]] = [[] for _ in range(d)]
        for i, p in enumerate(packs):
            per[i % d].append(p)
        return per

    def _time(self, lay: Layout, rs: int, s: np.ndarray, packs) -> tuple[float, list[PackedReplica]]:
        d = self.cluster.num_gpus // lay.size
        co = self.cm.coeffs(lay, rs)
        sync = self.cm.sync_time(lay, d)
        reps = []
        worst = 0.0
        for mbs in self._deal(packs, d):
            pipe = self._pipeline(co, lay, s, mbs)
            worst = max(worst, pipe + sync)
            reps.append((mbs, pipe, sync))
        return worst, reps

    # ------------------------------------------------------------------ per iteration
    def plan_iteration(self, index: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        s = self._check_input(sample_ids, lengths)
        if len(s) and s.max() > self.max_seq_len:
            raise PlanningError(f"a sequence of {int(s.max())} tokens is longer than the pack length {self.max_seq_len}")
        packs = self._packs(s, self.layout, self.rs)
        if self.balance:
            packs = self._balanced(s, packs)
        _, reps = self._time(self.layout, self.rs, s, packs)
        out = []
        for (lay, ranks), (mbs, pipe, sync) in zip(self.replicas, reps):
            lengths = [self.cm.padded_lengths(lay, s[p].tolist()) for p in mbs]
            tokens = [float(sum(x)) if self.cm.quadratic(lay) else float(s[p].sum()) for x, p in zip(lengths, mbs)]
            peak = self.cm.replica_peak_bytes(lay, tokens, [self.rs] * len(mbs), mb_lengths=lengths)
            out.append(PackedReplica(lay, ranks, [(p, self.rs) for p in mbs], pipe + sync, pipe, sync, peak))
        return to_iteration_plan(index, sample_ids, out, self.cm)

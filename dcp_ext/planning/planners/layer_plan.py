"""Layer strategies (ParaDySe) and uneven stages for one packed replica: the adaptive planner's v2 pass.

Why it exists: a replica's (tp, cp) suits most of its micro-batches, not all: a micro-batch
of one long document runs its layers faster with more context parallelism (no TP
collectives, the key/value exchange hidden under attention), one of short documents with
more tensor parallelism. The plan contract v2 lets each micro-batch run any layer as
another re-factoring (tp', cp') of the replica's tp*cp ranks, at the price of a re-layout
of the hidden states at each change, and of holding those layers' parameters (and fp32
main grads) a second time, in the other shape. This pass decides, after stage 1 and 2
have placed, packed and fitted a replica, which micro-batches move which layers, by a
fast heuristic in ParaDySe's spirit, memory first and then time:

  * options: for every other re-factoring s of the replica's ranks (a library of
    strategies with one layout of ranks) and a block of k = all, 1/2, 1/4, ... of each
    stage's first layers, the micro-batches that gain from running that block as s adopt
    it (their time by the per-layer prices, re-layouts included, at their recompute);
    a second variant also lets every micro-batch that needs recompute adopt a
    memory-frugal s (one whose layers keep fewer bytes), so moving layers can replace recompute;
  * memory: the option's extra parameters are charged on every stage, then recompute is
    lowered where the option frees memory (adopters first: moving layers before
    recomputing) and, on one-stage replicas, raised where it overflows (by the exact
    per-stage accounting of `layer_memory`); an option that cannot fit is dropped;
  * time: the option's exact 1F1B makespan (every stage its own times) plus sync; the
    fastest option is kept only if it is faster than the replica without layer strategies
    (strictly), then checked once more by the simulator's own functions.

Uneven stages: with a stage split (`stage_split`) the replica is priced and fitted per
stage here too, with or without layer strategies; pipelines only.

Not for layouts whose memory is quadratic in document lengths (the CPU attention): there
the planner emits no layer strategies (the checks by documents would multiply).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layer_cost import LayerPrices, layer_local_params, refactorings, stage_bounds, where_of
from dcp_ext.planning.layer_memory import replica_peak_v2
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import LayerStrategy
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica
from dcp_ext.planning.planners.tables import TypeTable
from dcp_ext.planning.simulator import one_f_one_b_stages


def _terms(cm: CostModel, s, pp: int) -> dict:
    a = cm.act_terms(Layout(s[0], s[1], pp))
    return {k: v / s[1] for k, v in a.items()}


class ReplicaV2:
    """One packed replica's micro-batches, priced and fitted under block options (vectorised)."""

    def __init__(self, cm: CostModel, lp: LayerPrices, tt: TypeTable, rep: PackedReplica, s: Sequence[int],
                 split, num_replicas: int):
        self.cm, self.lp, self.tt, self.rep = cm, lp, tt, rep
        lay = self.layout = Layout(*rep.layout)
        self.home = (lay.tp, lay.cp)
        self.pp = lay.pp
        self.L = cm.model.num_layers
        self.split = tuple(split) if split else None
        self.bounds = stage_bounds(self.L, self.pp, self.split)
        self.where = [where_of(p, self.pp, self.split) for p in range(self.pp)]
        sl = s
        self.s2 = np.array([float(sum(sl[d] * sl[d] for d in docs)) for docs, _ in rep.micro_batches])
        self.T = np.array([float(sum(sl[d] for d in docs)) for docs, _ in rep.micro_batches])
        self.nd = np.array([float(len(docs)) for docs, _ in rep.micro_batches])
        self.m = len(rep.micro_batches)
        levels = tt.allowed_rs
        self.levels = np.asarray(levels, dtype=np.int64)
        self.lvl0 = np.array([levels.index(rs) if rs in levels else int(np.searchsorted(levels, rs))
                              for _, rs in rep.micro_batches], dtype=np.int64)
        self.lvl0 = np.minimum(self.lvl0, len(levels) - 1)
        self.sync = cm.sync_time(lay, num_replicas)
        self.free_base = cm.capacity_bytes - cm.state_bytes(lay, self.split)
        self.h = _terms(cm, self.home, self.pp)
        self.tied = cm.tied_bytes(lay)
        self.fh, self.bh = lp.layer_times(self.home, self.pp, self.s2, self.T, self.nd)
        self.fix = []
        for w in self.where:
            c = lp.fixed(self.home, self.pp, w)
            self.fix.append((c.c0_f + c.b_f * self.T, c.c0_b + c.b_b * self.T))
        self._alt: dict = {}

    def alt(self, s):
        got = self._alt.get(s)
        if got is None:
            fs, bs = self.lp.layer_times(s, self.pp, self.s2, self.T, self.nd)
            (p1, c1), (p2, c2) = self.lp.relayout_coeffs(self.home, s), self.lp.relayout_coeffs(s, self.home)
            rl = (p1 + p2) * self.T + (c1 + c2)
            got = self._alt[s] = (fs, bs, rl, _terms(self.cm, s, self.pp))
        return got

    def _stage_rs(self, lvl, n):
        R = self.levels[lvl] * self.pp
        return np.minimum(n, -(-R * n // self.L))

    def times(self, s, k: int, adopt, lvl) -> tuple[np.ndarray, np.ndarray]:
        """fwd[stage, micro-batch], bwd[stage, micro-batch]."""
        F = np.empty((self.pp, self.m))
        B = np.empty((self.pp, self.m))
        for p, (first, end) in enumerate(self.bounds):
            n = end - first
            rs = self._stage_rs(lvl, n)
            ff, fb = self.fix[p]
            if s is None:
                F[p] = ff + n * self.fh
                B[p] = fb + n * self.bh + rs * self.fh
                continue
            fs, bs, rl, _ = self.alt(s)
            kp = np.where(adopt, min(k, n), 0)
            a = np.minimum(kp, rs)
            c = np.maximum(0, rs - kp)
            move = np.where(adopt, rl, 0.0)
            F[p] = ff + kp * fs + (n - kp) * self.fh + move
            B[p] = fb + kp * bs + (n - kp) * self.bh + a * fs + c * self.fh + move
        return F, B

    def makespan(self, F, B) -> float:
        if self.m == 0:
            return 0.0
        if self.pp == 1:
            return float((F[0] + B[0]).sum())
        return one_f_one_b_stages(F.tolist(), B.tolist(), self.pp).makespan

    def peak(self, s, k: int, adopt, lvl, per_mb: bool = False):
        """(bytes over capacity, a micro-batch whose recompute would help most; -1 if none).
        per_mb (pp == 1 only): each micro-batch's own bytes over capacity instead."""
        h = self.h
        worst, culprit = -math.inf, -1
        top = len(self.levels) - 1
        st = self.alt(s)[3] if s is not None else None
        any_adopt = s is not None and bool(adopt.any())
        for p, (first, end) in enumerate(self.bounds):
            n = end - first
            rs = self._stage_rs(lvl, n)
            if st is not None:
                kp = np.where(adopt, min(k, n), 0)
            else:
                kp = np.zeros(self.m, dtype=np.int64)
            a = np.minimum(kp, rs)
            b = kp - a
            c = np.maximum(0, rs - kp)
            d = n - kp - c
            keep = h["emb"] + c * h["ckpt"] + d * h["full"]
            trans = np.where(c > 0, h["full"] + h["ws"] + h["work"], 0.0)
            trans = np.maximum(trans, np.where(d > 0, h["ws"] + h["work"], 0.0))
            if st is not None:
                keep = keep + a * st["ckpt"] + b * st["full"]
                trans = np.maximum(trans, np.where(a > 0, st["full"] + st["ws"] + st["work"], 0.0))
                trans = np.maximum(trans, np.where(b > 0, st["ws"] + st["work"], 0.0))
            free = self.free_base
            if any_adopt:
                m_ = self.cm.model
                free -= min(k, n) * layer_local_params(self.cm, s[0]) * (m_.param_bytes + m_.grad_bytes)
            kb, tb = keep * self.T, trans * self.T
            last = p == self.pp - 1
            if last:
                extra = np.maximum(0.0, h["last_keep"] + h["logits_trans"] + h["ws"] - trans)
                alone = kb + np.maximum((trans + extra) * self.T, tb + self.tied)
                over = alone - free
                if per_mb:
                    return over
                i = int(np.argmax(over))
                if over[i] > worst:
                    worst, culprit = over[i], (i if lvl[i] < top else -1)
            w = min(self.pp - p, self.m)
            if not last or w > 1:
                cs = np.concatenate([[0.0], np.cumsum(kb)])
                win = cs[w:] - cs[:-w]
                tmax = np.lib.stride_tricks.sliding_window_view(tb, w).max(axis=1)
                over = win + tmax - free
                j = int(np.argmax(over))
                if over[j] > worst:
                    span = [i for i in range(j, j + w) if lvl[i] < top]
                    worst, culprit = over[j], (max(span, key=lambda i: kb[i]) if span else -1)
        return worst, culprit

    def may_gain(self, s, k: int, adopt, gain, lvl) -> bool:
        """Whether an option can be faster at all (pp == 1): the adopters' gain at their
        recompute against the least that the micro-batches its memory squeezes must pay
        (each raises its recompute by a layer or more: at least one layer's forward)."""
        if np.any(adopt & (lvl > 0)):
            return True  # memory first: an adopter's recompute may drop
        over = self.peak(s, k, adopt, lvl, per_mb=True)
        squeezed = over > 0
        if not squeezed.any():
            return True
        fs = self.alt(s)[0]
        return float(gain[adopt].sum()) > float(np.minimum(self.fh, fs)[squeezed].sum())

    def refit(self, s, k: int, adopt, lvl, lower=()) -> np.ndarray | None:
        """Recompute levels that fit: lowered first for the micro-batches in `lower` (to the
        least level that still fits: the fit is monotone in the level), then raised where
        memory overflows (one stage; pipelines: not raised). None if nothing fits."""
        lvl = lvl.copy()
        lower = [i for i in lower if lvl[i] > 0]
        if self.pp == 1:
            # one stage, one micro-batch at a time: every micro-batch at every level, at once
            nlev = len(self.levels)
            grid = np.broadcast_to(np.arange(nlev)[:, None], (nlev, self.m))
            fits = self.peak(s, k, adopt, grid, per_mb=True) <= 0
            if not fits[-1].all():
                return None
            least = np.argmax(fits, axis=0)
            out = np.maximum(lvl, least)
            if lower:
                out[lower] = least[lower]
            return out
        if not lower and self.peak(s, k, adopt, lvl)[0] <= 0:
            return lvl
        if lower:
            # pipelines (windows couple the micro-batches): the largest decrement that fits
            # for all of them together, by bisection
            idx = np.asarray(lower)
            lo, hi = 0, int(lvl[idx].max())
            while lo < hi:
                mid = (lo + hi + 1) // 2
                trial = lvl.copy()
                trial[idx] = np.maximum(0, lvl[idx] - mid)
                if self.peak(s, k, adopt, trial)[0] <= 0:
                    lo = mid
                else:
                    hi = mid - 1
            lvl[idx] = np.maximum(0, lvl[idx] - lo)
        if s is not None:
            # pipelines: an option must fit at the recompute it has (lowered or not): raising
            # recompute window by window costs more planning time than such options gain
            return lvl if self.peak(s, k, adopt, lvl)[0] <= 0 else None
        # the replica itself on its stage split: raise where the fullest window overflows
        for _ in range(self.m * len(self.levels) + 1):
            over, i = self.peak(s, k, adopt, lvl)
            if over <= 0:
                return lvl
            if i < 0:
                return None
            lvl[i] += 1
        return None

    def strategies(self, s, k: int, adopt) -> list | None:
        """Each micro-batch's LayerStrategy list (None: home everywhere)."""
        out = []
        for i in range(self.m):
            if s is None or not adopt[i]:
                out.append(None)
                continue
            entries: list[list] = []
            for first, end in self.bounds:
                kp = min(k, end - first)
                for lo, hi, st in ((first, first + kp - 1, s), (first + kp, end - 1, self.home)):
                    if hi < lo:
                        continue
                    if entries and entries[-1][2] == st and entries[-1][1] == lo - 1:
                        entries[-1][1] = hi
                    else:
                        entries.append([lo, hi, st])
            out.append([LayerStrategy(lo, hi, st[0], st[1]) for lo, hi, st in entries])
        return out


def block_sizes(bounds, count: int = 3) -> list[int]:
    """Layers per stage an option moves: the whole stage, half of it, a quarter (at least 1)."""
    biggest = max(e - f for f, e in bounds)
    out, k = [], biggest
    while k >= 1 and len(out) < count:
        out.append(k)
        k //= 2
    return out


def plan_v2(cm: CostModel, lp: LayerPrices, tt: TypeTable, rep: PackedReplica, s: Sequence[int], split,
            num_replicas: int, layer_strategies: bool) -> PackedReplica:
    """The replica with its stage split applied (priced and fitted per stage) and, when
    `layer_strategies`, the layer strategies that lower its time (see the module docstring)."""
    lay = Layout(*rep.layout)
    split = tuple(split) if split and lay.pp > 1 else None
    if not rep.micro_batches or cm.quadratic(lay):
        if split is not None and not cm.quadratic(lay):  # an idle replica still runs its type
            return dataclasses.replace(rep, stage_layers=split)
        return rep
    if split is None and (not layer_strategies or lay.tp * lay.cp == 1):
        return rep
    R = ReplicaV2(cm, lp, tt, rep, s, split, num_replicas)
    no = np.zeros(R.m, dtype=bool)
    if split is not None:
        lvl = R.refit(None, 0, no, R.lvl0)
        if lvl is None:  # cannot happen for splits chosen by stage_split (full recompute fits)
            raise PlanningError(f"{lay} replica: its micro-batches do not fit its stage split {split}")
        base_lvl = lvl
        base_t = R.makespan(*R.times(None, 0, no, lvl)) + R.sync
    else:
        base_lvl = R.lvl0
        base_t = rep.time_s
    best = (base_t, None, 0, no, base_lvl)
    if layer_strategies and lay.tp * lay.cp > 1:
        F0, B0 = R.times(None, 0, no, base_lvl)
        t0 = (F0 + B0).sum(axis=0)
        alts = [st for st in refactorings(cm, lay.tp, lay.cp) if st != R.home]
        h = R.h
        for st in alts:
            terms = R.alt(st)[3]
            # memory-frugal: its layers keep (or peak at) clearly fewer bytes than home's
            frugal = (terms["full"] < 0.99 * h["full"]
                      or terms["full"] + terms["ws"] + terms["work"] < 0.99 * (h["full"] + h["ws"] + h["work"]))
            memory_variant = frugal and bool(np.any(base_lvl > 0))
            for k in block_sizes(R.bounds):
                yes = np.ones(R.m, dtype=bool)
                F1, B1 = R.times(st, k, yes, base_lvl)
                gain = t0 - (F1 + B1).sum(axis=0)
                if not np.any(gain > 0) and not memory_variant:
                    break  # a smaller block gains less: its layers save less, its re-layouts cost the same
                variants = [gain > 0] + ([(gain > 0) | (base_lvl > 0)] if memory_variant else [])
                raised = False
                for adopt in variants:
                    if not adopt.any():
                        continue
                    if R.pp == 1 and not R.may_gain(st, k, adopt, gain, base_lvl):
                        raised = True  # memory binds: a smaller block may still gain
                        continue
                    lower = sorted(np.nonzero(adopt & (base_lvl > 0))[0].tolist(), key=lambda i: -R.T[i])
                    lvl = R.refit(st, k, adopt, base_lvl, lower)
                    if lvl is None:
                        raised = True
                        continue
                    raised |= bool(np.any(lvl > base_lvl))
                    t = R.makespan(*R.times(st, k, adopt, lvl)) + R.sync
                    if t < best[0] * (1 - 1e-9):
                        best = (t, st, k, adopt, lvl)
                if not raised:
                    break  # memory did not bind: a smaller block can only gain less
    t, st, k, adopt, lvl = best
    if split is None and st is None:
        return rep
    R.base_lvl = base_lvl
    return _exact(cm, lp, R, rep, st, k, adopt, lvl, base_t if st is not None else None)


def _exact(cm, lp, R: ReplicaV2, rep: PackedReplica, st, k, adopt, lvl, beat: float | None) -> PackedReplica:
    """The option as a PackedReplica, priced by the simulator's own functions; with `beat`,
    only if it is faster than that and fits (else the replica without layer strategies)."""
    from dcp_ext.planning.layer_cost import stage_times_arrays

    levels = R.tt.allowed_rs
    mbs = [(docs, int(levels[int(l)])) for (docs, _), l in zip(rep.micro_batches, lvl)]
    strategies = R.strategies(st, k, adopt)
    if strategies is not None and all(x is None for x in strategies):
        strategies = None
    F = np.empty((R.pp, R.m))
    B = np.empty((R.pp, R.m))
    groups: dict = {}
    mem = []
    for i, (docs, rs) in enumerate(mbs):
        Rl = cm.recompute_layers(R.layout, rs)
        strat = strategies[i] if strategies else None
        groups.setdefault((Rl, tuple(strat) if strat else None), []).append(i)
        mem.append((R.T[i], Rl, strat, None))
    for (Rl, strat), idx in groups.items():
        F[:, idx], B[:, idx] = stage_times_arrays(lp, R.layout, R.split, R.s2[idx], R.T[idx], R.nd[idx], Rl,
                                                  list(strat) if strat else None)
    pipe = R.makespan(F, B)
    peak = replica_peak_v2(cm, R.layout, R.split, mem)
    t = pipe + R.sync
    if beat is not None and (t >= beat * (1 - 1e-9) or peak > cm.capacity_bytes * (1 + 1e-9)):
        if R.split is None:
            return rep
        return _exact(cm, lp, R, rep, None, 0, np.zeros(R.m, dtype=bool), R.base_lvl, None)
    return PackedReplica(R.layout, list(rep.ranks), mbs, t, pipe, R.sync, peak, stage_layers=R.split,
                         layer_strategies=strategies)


def v2_pass(cm: CostModel, pool_tables: dict, reps: list[PackedReplica], s: Sequence[int],
            layer_strategies: bool) -> list[PackedReplica]:
    """The plan contract v2 pass over a chosen plan's replicas (`plan_v2`): every pipelined
    replica gets its layout's stage split (priced and fitted per stage); with
    `layer_strategies`, layer strategies then go to the slowest replica, then the next
    slowest, while that lowers the iteration's time (the slowest replica decides it: once it
    cannot get faster, no other replica's moves would change the plan's time). It never
    makes a replica slower."""
    from dcp_ext.planning.simulator import layer_prices

    lp = layer_prices(cm)
    R = len(reps)
    out = [plan_v2(cm, lp, pool_tables[r.layout], r, s, cm.stage_splits.get(r.layout), R, False) for r in reps]
    if not layer_strategies:
        return out
    tried: set[int] = set()
    while len(tried) < R:
        k = max((i for i in range(R) if i not in tried), key=lambda i: (out[i].time_s, -i))
        tried.add(k)
        r = out[k]
        new = plan_v2(cm, lp, pool_tables[r.layout], r, s, r.stage_layers, R, True)
        if new.time_s >= r.time_s:
            break
        out[k] = new
    return out

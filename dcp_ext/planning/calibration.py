"""Online recalibration: the cost model refitted, while training, from what the run measures.

Why it exists: the planner is only as good as its prices, and the analytic model (or a
profile from another day) is a guess about this machine. The runtime times every
micro-batch's forward+backward on every stage, each replica's pull+push and the whole
iteration; the reduced numbers (identical on every rank) come here as `Observation`s. A
refit turns a sliding window of them into corrections of the prior (the analytic
coefficients, or the profile's):

    stage time of a micro-batch = k0*c0 + ka*a*S2 + kb*(b*T + cp excess) + kc*c*n

with (c0, a, b, c) the prior's, per (layout, recompute level). The k's are a non-negative
least-squares fit in relative error, pulled towards the pooled fit of every layout
(ridge), which is itself pulled towards 1 (the prior): a layout seen a few times moves
a little, one never seen takes the pooled correction. Outliers (a preempted core, a
page fault storm) are dropped by their residual (beyond 3 scaled MADs) before the final
fit. Sync time takes the window's median measured/prior ratio per layout; what the
iteration spends outside its replicas (optimizer step, loss reduction, packing, the
loop) is the window's median and is added to an iteration's predicted time.

Every number is computed in plain Python floats from the observations in their order,
so every rank, on any CPU, refits to the same bits and keeps planning the same plans.
The state (windows and observations not yet applied) is a JSON-able dict for checkpoints.
Pure: no torch, no runtime.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import IterationPlan

WINDOW = 48  # micro-batches kept per (layout, recompute level); sync and overhead windows alike
RIDGE = 0.05  # weight of the pull towards the pooled fit, in units of one observation's relative error
OUTLIER_MADS = 3.0
RATIO_WINDOW = 16  # training steps kept per kind (one layout, mixed layouts) for `mix_factor`
RATIO_MIN = 3  # steps of each kind before the mixed ones are priced by what they measured


@dataclass(frozen=True)
class MicroBatchSample:
    layout: tuple[int, int, int]
    rs: int  # recomputed layers per stage
    s2: float
    tokens: float
    n_docs: int
    stage_s: float  # measured forward+backward of the micro-batch, summed over stages, / pp


@dataclass(frozen=True)
class SyncSample:
    layout: tuple[int, int, int]
    num_replicas: int
    seconds: float


@dataclass
class Observation:
    """One iteration's measurements, reduced over ranks (identical everywhere)."""

    iteration: int
    micro_batches: list[MicroBatchSample]
    syncs: list[SyncSample]
    outside_s: float  # iteration wall time minus its slowest replica's
    memory_excess: float = 0.0  # bytes: the most any rank held above its replica's predicted peak
    # a training step's measured wall time over the time its plan predicted, and whether the plan
    # mixed layouts (None: unknown, a step of a checkpoint from before)
    mixed: bool | None = None
    wall_ratio: float = 0.0
    probe: bool = False  # a step of the startup calibration (no update: its time outside replicas is not a step's)


def observe(it: IterationPlan, lengths_of: dict[int, int], mb_seconds: Sequence[Sequence[float]],
            sync_s: Sequence[float], replica_s: Sequence[float], wall_s: float, stage_recompute,
            memory_excess: float = 0.0, probe: bool = False) -> Observation:
    """An Observation from a plan and the runtime's reduced timings: `mb_seconds[r][j]` the
    j-th micro-batch of replica r, forward+backward summed over its stages; `sync_s[r]`
    pull+push (0 when overlapped: not observed); `replica_s[r]` the replica's whole step;
    `wall_s` the iteration's. `stage_recompute(layout, recompute_layers)` gives the plan's
    model-wide recompute count per stage (CostModel.stage_recompute). `memory_excess`: bytes
    the ranks held above their replicas' predicted peaks (the most over ranks; 0 unmeasured).
    `probe`: not a training step (its plan's prediction is not compared with its wall time)."""
    mbs, syncs = [], []
    n = len(it.replicas)
    for r, rep in enumerate(it.replicas):
        lay = Layout(rep.tp, rep.cp, rep.pp)
        for j, mb in enumerate(rep.micro_batches):
            secs = float(mb_seconds[r][j])
            if secs <= 0:
                continue
            ls = [float(lengths_of[s]) for s in mb.sample_ids]
            mbs.append(MicroBatchSample(tuple(lay), int(stage_recompute(lay, mb.recompute_layers)),
                                        sum(x * x for x in ls), sum(ls), len(ls), secs / lay.pp))
        if sync_s[r] > 0:
            syncs.append(SyncSample(tuple(lay), n, float(sync_s[r])))
    slowest = max((float(x) for x in replica_s), default=0.0)
    mixed = None if probe or it.predicted_time_s <= 0 else len({(r.tp, r.cp, r.pp) for r in it.replicas}) > 1
    return Observation(int(it.index), mbs, syncs, max(0.0, float(wall_s) - slowest), max(0.0, float(memory_excess)),
                       mixed, float(wall_s) / it.predicted_time_s if mixed is not None else 0.0, bool(probe))


# ----------------------------------------------------------------------------- the fit
def _solve(A: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (small, dense, plain floats)."""
    n = len(y)
    M = [row[:] + [y[i]] for i, row in enumerate(A)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        if abs(M[p][c]) < 1e-300:
            return None
        M[c], M[p] = M[p], M[c]
        for r in range(c + 1, n):
            f = M[r][c] / M[c][c]
            if f:
                for k in range(c, n + 1):
                    M[r][k] -= f * M[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (M[c][n] - sum(M[c][k] * x[k] for k in range(c + 1, n))) / M[c][c]
    return x


def ridge_nnls(rows: Sequence[Sequence[float]], y: Sequence[float], prior: Sequence[float], ridge: float) -> list[float]:
    """argmin_k>=0 sum_i (rows_i.k - y_i)^2 + ridge * sum_j (k_j - prior_j)^2, exactly: the best
    of the unconstrained solutions over every support whose values are non-negative."""
    m = len(prior)
    G = [[sum(r[a] * r[b] for r in rows) + (ridge if a == b else 0.0) for b in range(m)] for a in range(m)]
    h = [sum(r[a] * v for r, v in zip(rows, y)) + ridge * prior[a] for a in range(m)]

    def loss(k):
        fit = sum((sum(r[j] * k[j] for j in range(m)) - v) ** 2 for r, v in zip(rows, y))
        return fit + ridge * sum((k[j] - prior[j]) ** 2 for j in range(m))

    best, best_loss = [0.0] * m, loss([0.0] * m)
    for size in range(m, 0, -1):
        for support in itertools.combinations(range(m), size):
            sol = _solve([[G[a][b] for b in support] for a in support], [h[a] for a in support])
            if sol is None or min(sol) < 0:
                continue
            k = [0.0] * m
            for j, v in zip(support, sol):
                k[j] = v
            lk = loss(k)
            if lk < best_loss:
                best, best_loss = k, lk
    return best


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return 0.0 if n == 0 else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def robust_fit(parts: Sequence[Sequence[float]], y: Sequence[float], prior: Sequence[float]) -> list[float]:
    """Corrections k for y ~ parts.k in relative error, pulled towards `prior`; refitted once
    without the observations whose residual is an outlier."""
    rows = [[p / v for p in ps] for ps, v in zip(parts, y)]
    ones = [1.0] * len(y)
    k = ridge_nnls(rows, ones, prior, RIDGE)
    if len(y) >= 5:
        res = [sum(a * b for a, b in zip(r, k)) - 1.0 for r in rows]
        med = _median(res)
        mad = _median([abs(x - med) for x in res])
        bound = OUTLIER_MADS * 1.4826 * mad + 0.02
        keep = [i for i, x in enumerate(res) if abs(x - med) <= bound]
        if len(keep) < len(rows):
            k = ridge_nnls([rows[i] for i in keep], [1.0] * len(keep), prior, RIDGE)
    return k


class Calibration:
    """Sliding windows of observations and the corrections fitted from them."""

    def __init__(self, window: int = WINDOW):
        self._reset(window)

    def _reset(self, window: int) -> None:
        self.window = int(window)
        self.micro_batches: dict[tuple, deque] = {}
        self.syncs: dict[tuple, deque] = {}
        self.outside: deque = deque(maxlen=self.window)
        # measured / predicted wall time of the last training steps, by whether they mixed layouts
        self.wall_ratios = {False: deque(maxlen=RATIO_WINDOW), True: deque(maxlen=RATIO_WINDOW)}
        self.pending: list[Observation] = []
        self.applied_through: int | None = None
        self.version = 0
        self._k: dict[tuple, list[float]] = {}
        self._k_pooled = [1.0, 1.0, 1.0, 1.0]
        self._sync_ratio: dict[tuple, float] = {}
        self._sync_pooled = 1.0
        self.outside_s = 0.0
        # bytes the runtime holds beyond the cost model's account (allocator slack, the step's
        # host-side work, communicator staging): the largest excess measured, charged against
        # the capacity from the next plan on (`CostModel.capacity_bytes`)
        self.memory_reserve = 0.0
        self.memory_excess = 0.0  # the most measured (what the reserve would be, could it all be charged)

    # ------------------------------------------------------------------ input
    def add(self, obs: Observation) -> None:
        """Queue an iteration's measurements; they count from the next `apply`."""
        self.pending.append(obs)

    def apply(self, cm) -> bool:
        """Move the queued observations into the windows and refit against `cm`'s prior
        (`prior_coeffs`, `prior_sync_time`). True when anything changed."""
        if not self.pending:
            return False
        for obs in self.pending:
            for s in obs.micro_batches:
                self.micro_batches.setdefault((s.layout, s.rs), deque(maxlen=self.window)).append(s)
            for s in obs.syncs:
                self.syncs.setdefault(s.layout, deque(maxlen=self.window)).append(s)
            if not obs.probe:
                self.outside.append(obs.outside_s)
            if obs.mixed is not None and obs.wall_ratio > 0 and not obs.probe:
                self.wall_ratios[bool(obs.mixed)].append(float(obs.wall_ratio))
            self.memory_excess = max(self.memory_excess, float(obs.memory_excess))
            self.applied_through = obs.iteration
        self.pending = []
        self._refit(cm)
        self.version += 1
        return True

    # ------------------------------------------------------------------ fit
    @staticmethod
    def _parts(cm, s: MicroBatchSample) -> list[float]:
        co = cm.prior_coeffs(Layout(*s.layout), s.rs)
        return [co.c0, co.a * s.s2, co.b * s.tokens + co.excess(s.s2, s.tokens), co.c * s.n_docs]

    def _refit(self, cm) -> None:
        every = [s for key in sorted(self.micro_batches) for s in self.micro_batches[key]]
        if every:
            self._k_pooled = robust_fit([self._parts(cm, s) for s in every], [s.stage_s for s in every],
                                        [1.0, 1.0, 1.0, 1.0])
        self._k = {}
        for key in sorted(self.micro_batches):
            ss = list(self.micro_batches[key])
            self._k[key] = robust_fit([self._parts(cm, s) for s in ss], [s.stage_s for s in ss], self._k_pooled)
        ratios = {}
        for lay in sorted(self.syncs):
            rs = [s.seconds / p for s in self.syncs[lay]
                  if (p := cm.prior_sync_time(Layout(*lay), s.num_replicas)) > 0]
            if rs:
                ratios[lay] = _median(rs)
        self._sync_ratio = ratios
        self._sync_pooled = _median(list(ratios.values())) if ratios else 1.0
        self.outside_s = _median(list(self.outside))

    # ------------------------------------------------------------------ output
    @property
    def observed(self) -> bool:
        return self.version > 0

    def corrections(self, layout: Layout, rs: int) -> list[float]:
        """(k0, ka, kb, kc) for (layout, rs): its own fit, else the pooled one."""
        return self._k.get((tuple(layout), int(rs)), self._k_pooled)

    def adjust(self, layout: Layout, rs: int, prior):
        """The prior's stage coefficients with this calibration's corrections."""
        from dataclasses import replace

        k0, ka, kb, kc = self.corrections(layout, rs)
        return replace(prior, c0_f=prior.c0_f * k0, c0_b=prior.c0_b * k0, a_f=prior.a_f * ka, a_b=prior.a_b * ka,
                       b_f=prior.b_f * kb, b_b=prior.b_b * kb, c_f=prior.c_f * kc, c_b=prior.c_b * kc,
                       cp_att=prior.cp_att * ka, cp_comm=prior.cp_comm * kb)

    @property
    def mix_factor(self) -> float:
        """What a plan that mixes layouts costs beyond its predicted time, relative to a plan of
        one layout: the median measured/predicted wall time of the last mixed training steps
        over that of the last single-layout ones (1.0 until each kind has `RATIO_MIN` steps).
        The cost model prices each replica; what it leaves out of a mix (replicas that finish
        apart when their layouts' prices are off in different directions, the exchange
        between unlike layouts, cores shared unevenly) shows here, and the planner weighs
        mixed plans by it: where a mix loses to one layout on what was measured, one layout runs."""
        single, mixed = self.wall_ratios[False], self.wall_ratios[True]
        if len(single) < RATIO_MIN or len(mixed) < RATIO_MIN:
            return 1.0
        return min(2.0, max(0.5, _median(list(mixed)) / _median(list(single))))

    def sync_ratio(self, layout: Layout) -> float:
        return self._sync_ratio.get(tuple(layout), self._sync_pooled)

    def summary(self) -> str:
        """`k 1.31/0.92/1.08/1.00 over 96 micro-batches, sync x0.85, outside 41 ms`."""
        n = sum(len(d) for d in self.micro_batches.values())
        k = "/".join(f"{x:.2f}" for x in self._k_pooled)
        return f"c0/attention/token/doc x{k} over {n} micro-batches, sync x{self._sync_pooled:.2f}, " \
               f"outside replicas {1000 * self.outside_s:.0f} ms, memory beyond the model {self.memory_excess / 2**20:.0f} MiB " \
               f"(reserved {self.memory_reserve / 2**20:.0f}), mixed layouts x{self.mix_factor:.2f}"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        def mb(s):
            return [list(s.layout), s.rs, s.s2, s.tokens, s.n_docs, s.stage_s]

        def obs(o):
            return {"iteration": o.iteration, "micro_batches": [mb(s) for s in o.micro_batches],
                    "syncs": [[list(s.layout), s.num_replicas, s.seconds] for s in o.syncs], "outside_s": o.outside_s,
                    "memory_excess": o.memory_excess, "mixed": o.mixed, "wall_ratio": o.wall_ratio, "probe": o.probe}

        return {"window": self.window, "applied_through": self.applied_through,
                "micro_batches": [mb(s) for key in sorted(self.micro_batches) for s in self.micro_batches[key]],
                "syncs": [[list(s.layout), s.num_replicas, s.seconds] for lay in sorted(self.syncs)
                          for s in self.syncs[lay]],
                "outside": list(self.outside), "pending": [obs(o) for o in self.pending],
                "wall_ratios": {"single": list(self.wall_ratios[False]), "mixed": list(self.wall_ratios[True])},
                "memory_reserve": self.memory_reserve, "memory_excess": self.memory_excess}

    def load_state_dict(self, state: dict, cm) -> None:
        """Windows and queued observations from a checkpoint; refitted against `cm`."""
        def mb(v):
            return MicroBatchSample(tuple(v[0]), int(v[1]), float(v[2]), float(v[3]), int(v[4]), float(v[5]))

        def sync(v):
            return SyncSample(tuple(v[0]), int(v[1]), float(v[2]))

        self._reset(int(state.get("window", self.window)))
        for s in map(mb, state.get("micro_batches", [])):
            self.micro_batches.setdefault((s.layout, s.rs), deque(maxlen=self.window)).append(s)
        for s in map(sync, state.get("syncs", [])):
            self.syncs.setdefault(s.layout, deque(maxlen=self.window)).append(s)
        self.outside.extend(float(x) for x in state.get("outside", []))
        ratios = state.get("wall_ratios", {})
        self.wall_ratios[False].extend(float(x) for x in ratios.get("single", []))
        self.wall_ratios[True].extend(float(x) for x in ratios.get("mixed", []))
        self.applied_through = state.get("applied_through")
        self.pending = [Observation(int(o["iteration"]), [mb(v) for v in o["micro_batches"]],
                                    [sync(v) for v in o["syncs"]], float(o["outside_s"]),
                                    float(o.get("memory_excess", 0.0)), o.get("mixed"), float(o.get("wall_ratio", 0.0)),
                                    bool(o.get("probe", False)))
                        for o in state.get("pending", [])]
        self.memory_reserve = float(state.get("memory_reserve", 0.0))
        self.memory_excess = float(state.get("memory_excess", 0.0))
        if self.micro_batches or self.syncs or self.outside:
            self._refit(cm)
            self.version = 1


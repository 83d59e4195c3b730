"""The cost model every assignment kernel optimises, and the result types they return.

Why a module of its own: the C++ kernels, the Python reference, the baselines, the exact
MILP and the planner must all price a plan the same way, to the last bit. The float
operations here are written in the exact order the C++ side (csrc/assign_core.hpp) uses.

All costs are seconds per pipeline stage:
    sequence cost       cost(s)  = a*s*s + b*s + c
    micro-batch cost             = mb_overhead + sum of its sequence costs
    replica time                 = sum of micro-batch costs + (pp - 1) * largest one
                                   (1F1B with pipeline fill and drain)

Stage 1 prices a replica before packing with `estimate`, a LOWER BOUND of replica_time
over every packing of the same sequences. With W the sum of sequence costs, T their
tokens, m the largest sequence cost, n their count, o = mb_overhead, q = pp - 1:
    any packing into v micro-batches has v >= v0 = ceil(T / max_mb_tokens), v <= n,
    sum of micro-batch costs = W + v*o, and largest >= o + max(W/v, m), so
    replica_time >= W + q*o + min_{v0 <= v <= n} [ v*o + q*max(W/v, m) ] =: estimate.
The bracket is convex in v; its real minimiser is min(sqrt(q*W/o), W/m), so the integer
minimum is at the floor or ceiling of that, clamped to [v0, n]. For pp == 1 it is
W + o*v0. Stage 2 then searches packings that reach it (see ref_pack.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ReplicaCost:
    """One replica's cost function and capacity; all costs in seconds, per pipeline stage."""

    a: float  # per-sequence quadratic term (causal attention per document): a*s^2
    b: float  # per token
    c: float  # per sequence
    mb_overhead: float  # per micro-batch constant
    pp: int  # pipeline stages
    max_seq_len: int  # longest single sequence this replica can hold
    max_mb_tokens: int  # token cap of one micro-batch (>= max_seq_len normally)

    @property
    def seq_cap(self) -> int:
        """Longest sequence this replica accepts: it must fit one micro-batch too."""
        return min(self.max_seq_len, self.max_mb_tokens)

    def as_tuple(self) -> tuple:
        return (float(self.a), float(self.b), float(self.c), float(self.mb_overhead),
                int(self.pp), int(self.max_seq_len), int(self.max_mb_tokens))


@dataclass
class BalanceResult:
    assignment: np.ndarray  # int64, len n: replica index of each sequence
    replica_times: np.ndarray  # float64, len R: stage-1 estimate of each replica
    makespan: float  # max of replica_times
    greedy_makespan: float = float("nan")  # the greedy start of the first attempt


@dataclass
class PlanResult:
    assignment: np.ndarray  # int64, len n
    micro_batches: list  # per replica: list of micro-batches, each a list of indices
    replica_times: np.ndarray  # float64, len R: replica_time of the packed micro-batches
    makespan: float
    estimates: np.ndarray | None = None  # stage-1 estimates (None for baselines)


# ---- the shared arithmetic (keep the operation order in step with csrc/assign_core.hpp)

def seq_cost(p: tuple, s: int) -> float:
    """a*s*s + b*s + c for params tuple p = ReplicaCost.as_tuple()."""
    x = float(s)
    return p[0] * x * x + p[1] * x + p[2]


def estimate(p: tuple, W: float, T: int, m: float, n: int) -> float:
    """Stage-1 lower bound of replica_time (module docstring); 0 for an empty replica."""
    if n == 0:
        return 0.0
    o = p[3]
    q = p[4] - 1
    cap = p[6]
    v0 = (T + cap - 1) // cap
    if q == 0:
        return W + o * v0
    vk = W / m if m > 0.0 else 0.0
    vc = min(math.sqrt(q * W / o), vk) if o > 0.0 else vk
    f = math.floor(vc) if vc < n else n
    best = math.inf
    for v in (f, f + 1):
        v = min(max(v, v0), n)
        val = v * o + q * max(W / v, m)
        if val < best:
            best = val
    return W + q * o + best


def mb_cost(p: tuple, lengths: Sequence[int], mb: Sequence[int]) -> float:
    acc = p[3]
    for i in mb:
        acc += seq_cost(p, lengths[i])
    return acc


def replica_time_params(p: tuple, lengths: Sequence[int], micro_batches) -> float:
    total, largest = 0.0, 0.0
    for mb in micro_batches:
        if len(mb) == 0:
            continue
        cst = mb_cost(p, lengths, mb)
        total += cst
        if cst > largest:
            largest = cst
    return total + (p[4] - 1) * largest


def replica_time(lengths, micro_batches, rc: ReplicaCost) -> float:
    """Time of one replica running `micro_batches` (lists of indices into `lengths`).

    sum of micro-batch costs + (pp - 1) * the largest; empty micro-batches are ignored.
    """
    lengths = np.asarray(lengths).tolist() if isinstance(lengths, np.ndarray) else lengths
    return replica_time_params(rc.as_tuple(), lengths, micro_batches)

"""The public entry points of dcp_ext.assign: validate, fill in defaults, run a backend.

Defaults that depend on the input size (restarts, local-search budgets) are resolved
here, once, so both implementations receive the same numbers and return the same plan.
"""
from __future__ import annotations

import numpy as np

from . import backend as _backend
from .model import BalanceResult, PlanResult, ReplicaCost, replica_time_params
from .validate import check_count, check_fits, check_lengths, check_replica, check_replicas

BASELINES = ("megatron", "bucketing", "isf", "hbp")


def auto_restarts(n: int) -> int:
    """Seeded restarts of stage 1: many for small inputs, none for huge ones."""
    if n <= 100:
        return 16
    if n <= 1000:
        return 4
    return 0


def auto_budget(n: int) -> int:
    """Estimate evaluations one local search may spend (deterministic work bound)."""
    return 10_000 + n


def auto_starts(n: int) -> int:
    """Greedy starts of stage 1 (see ref_balance.START_QUANTILES): all for small inputs."""
    if n <= 1000:
        return 7
    if n <= 5000:
        return 3
    return 1


def auto_pack_restarts(n: int) -> int:
    return 4 if n <= 64 else 0


def _seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return int(seed) & ((1 << 64) - 1)


def _resolve(n, restarts, ls_budget, starts):
    restarts = auto_restarts(n) if restarts is None else check_count("restarts", restarts, 0)
    ls_budget = auto_budget(n) if ls_budget is None else check_count("ls_budget", ls_budget, 0)
    starts = auto_starts(n) if starts is None else check_count("starts", starts, 1)
    return restarts, ls_budget, starts


def balance(lengths, replicas, *, seed=0, restarts=None, local_search=True, ls_budget=None, starts=None,
            impl=None) -> BalanceResult:
    """Stage 1: a replica per sequence minimising the largest stage-1 estimate.

    The estimate (model.estimate) is a lower bound of replica_time over all packings.
    starts / restarts / ls_budget default to sizes picked by auto_starts / auto_restarts /
    auto_budget; starts=1, restarts=0, local_search=False returns the plain greedy;
    impl forces 'cpp' or 'python'.
    """
    arr = check_lengths(lengths)
    params = check_replicas(replicas)
    check_fits(arr, params)
    restarts, ls_budget, starts = _resolve(arr.size, restarts, ls_budget, starts)
    be = _backend.get(impl)
    assignment, est, ms, greedy_ms = be.balance(arr, params, _seed(seed), restarts, bool(local_search), ls_budget,
                                                starts)
    return BalanceResult(assignment=np.asarray(assignment, dtype=np.int64),
                         replica_times=np.asarray(est, dtype=np.float64),
                         makespan=float(ms), greedy_makespan=float(greedy_ms))


def pack(lengths, rc: ReplicaCost, *, seed=0, restarts=None, ls_budget=None, impl=None) -> list[list[int]]:
    """Stage 2: indices into `lengths` grouped into micro-batches minimising replica_time."""
    arr = check_lengths(lengths)
    p = check_replica(rc)
    check_fits(arr, [p])
    restarts = auto_pack_restarts(arr.size) if restarts is None else check_count("restarts", restarts, 0)
    ls_budget = auto_budget(arr.size) if ls_budget is None else check_count("ls_budget", ls_budget, 0)
    return _backend.get(impl).pack(arr, p, _seed(seed), restarts, ls_budget)


def _plan_result(arr, params, mbs, times=None, est=None, assignment=None) -> PlanResult:
    if assignment is None:
        assignment = np.full(arr.size, -1, dtype=np.int64)
        for r, rmbs in enumerate(mbs):
            for mb in rmbs:
                assignment[mb] = r
    else:
        assignment = np.asarray(assignment, dtype=np.int64)
    if times is None:
        lst = arr.tolist()
        times = [replica_time_params(params[r], lst, mbs[r]) for r in range(len(params))]
    times = np.asarray(times, dtype=np.float64)
    return PlanResult(assignment=assignment, micro_batches=mbs, replica_times=times,
                      makespan=float(times.max()) if times.size else 0.0,
                      estimates=None if est is None else np.asarray(est, dtype=np.float64))


def plan_replicas(lengths, replicas, *, seed=0, restarts=None, ls_budget=None, starts=None, pack_restarts=None,
                  calib_rounds=1, impl=None) -> PlanResult:
    """Stage 1 + stage 2: assignment, per-replica micro-batches (indices into lengths),
    per-replica replica_time, makespan, and the stage-1 estimates.

    calib_rounds: reruns of stage 1 with each replica's costs scaled by its packing loss
    (ref_plan.py); 0 gives the plain two-stage plan."""
    arr = check_lengths(lengths)
    params = check_replicas(replicas)
    check_fits(arr, params)
    restarts, ls_budget, starts = _resolve(arr.size, restarts, ls_budget, starts)
    pr = (auto_pack_restarts(arr.size // len(params)) if pack_restarts is None
          else check_count("pack_restarts", pack_restarts, 0))
    calib_rounds = check_count("calib_rounds", calib_rounds, 0)
    assignment, mbs, times, est = _backend.get(impl).plan(arr, params, _seed(seed), restarts, ls_budget, starts, pr,
                                                          auto_budget(arr.size), calib_rounds)
    return _plan_result(arr, params, mbs, times, est, assignment)


def pack_assignment(lengths, replicas, assignment, *, seed=0, pack_restarts=None, impl=None) -> PlanResult:
    """Stage 2 alone for a given assignment (e.g. one made by another planner)."""
    arr = check_lengths(lengths)
    params = check_replicas(replicas)
    a = np.asarray(assignment)
    if a.shape != arr.shape:
        raise ValueError(f"assignment has shape {a.shape}, lengths {arr.shape}")
    for i, r in enumerate(a.tolist()):
        if not isinstance(r, int) or not 0 <= r < len(params):
            raise ValueError(f"sequence {i} is assigned to replica {r!r}, not in [0, {len(params)})")
        if arr[i] > min(params[r][5], params[r][6]):
            raise ValueError(f"sequence {i} (length {int(arr[i])}) does not fit replica {r} "
                             f"(max_seq_len {params[r][5]}, max_mb_tokens {params[r][6]})")
    pr = (auto_pack_restarts(arr.size // len(params)) if pack_restarts is None
          else check_count("pack_restarts", pack_restarts, 0))
    mbs, times = _backend.get(impl).pack_assignment(arr, params, a.astype(np.int64), _seed(seed), pr,
                                                     auto_budget(arr.size))
    return _plan_result(arr, params, mbs, times, assignment=a.astype(np.int64))


def baseline_plan(name: str, lengths, replicas, *, seed=0, impl=None) -> PlanResult:
    """A baseline's full plan: 'megatron', 'bucketing', 'isf' or 'hbp' (ref_baselines.py)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; expected one of {BASELINES}")
    arr = check_lengths(lengths)
    params = check_replicas(replicas)
    check_fits(arr, params)
    mbs = _backend.get(impl).baseline(name, arr, params, _seed(seed))
    return _plan_result(arr, params, mbs)


def megatron_plan(lengths, replicas, *, seed=0, impl=None) -> PlanResult:
    return baseline_plan("megatron", lengths, replicas, seed=seed, impl=impl)


def bucketing_plan(lengths, replicas, *, seed=0, impl=None) -> PlanResult:
    return baseline_plan("bucketing", lengths, replicas, seed=seed, impl=impl)


def isf_plan(lengths, replicas, *, seed=0, impl=None) -> PlanResult:
    return baseline_plan("isf", lengths, replicas, seed=seed, impl=impl)


def hbp_plan(lengths, replicas, *, seed=0, impl=None) -> PlanResult:
    return baseline_plan("hbp", lengths, replicas, seed=seed, impl=impl)

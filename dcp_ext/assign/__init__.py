"""dcp_ext.assign: sequence-to-replica assignment (stage 1) and micro-batch packing (stage 2).

The planner calls these every iteration, so the kernels are C++ (csrc/, built into
dcp_ext.kernels._kernels); a pure-Python reference returns the very same results and is used,
with one warning, where the extension is not built (DCP_ASSIGN_IMPL=python forces it).

    balance(lengths, replicas)       -> BalanceResult   stage 1 (estimate: model.estimate)
    pack(lengths, rc)                -> micro-batches   stage 2 for one replica
    plan_replicas(lengths, replicas) -> PlanResult      stage 1 + stage 2
    replica_time(lengths, mbs, rc)   -> seconds         the cost model
    baseline_plan(name, ...)         -> PlanResult      megatron, bucketing, isf, hbp
    dcp_ext.assign.exact             HiGHS MILP optimum for small instances (needs highspy)
"""
from .api import (BASELINES, auto_budget, auto_pack_restarts, auto_restarts, auto_starts, balance, baseline_plan,
                  bucketing_plan, hbp_plan, isf_plan, megatron_plan, pack, pack_assignment, plan_replicas)
from .backend import cpp_available, default_backend
from .model import BalanceResult, PlanResult, ReplicaCost, estimate, replica_time, seq_cost

IMPLEMENTATION: str = default_backend().name

__all__ = [
    "BASELINES", "BalanceResult", "IMPLEMENTATION", "PlanResult", "ReplicaCost", "auto_budget",
    "auto_pack_restarts", "auto_restarts", "auto_starts", "balance", "baseline_plan", "bucketing_plan", "cpp_available",
    "estimate", "hbp_plan", "isf_plan", "megatron_plan", "pack", "pack_assignment", "plan_replicas",
    "replica_time", "seq_cost",
]

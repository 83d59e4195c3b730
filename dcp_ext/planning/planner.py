"""Entry point for planners: `make_planner(name, model, cluster, ...)`.

Why it exists: the runtime and the CLIs ask for a planner by name and get an object with
`replica_types()` and `plan_iteration(index, sample_ids, lengths)`; which class sits
behind a name is this module's business only. All planners are pure (no torch, no
process groups) and deterministic: the same inputs, in the same call order, give the same
plan on every rank.
"""
from __future__ import annotations

from typing import Any, Sequence

from dcp_ext.planning.planners.adaptive import AdaptivePlanner
from dcp_ext.planning.layout import ReplicaType
from dcp_ext.planning.planners.base import PlannerBase
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.tables import make_type_table
from dcp_ext.planning.planners.dynamic_cp import CPBucketsPlanner, DynamicCPPlanner
from dcp_ext.planning.planners.static import StaticPlanner
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

PLANNERS = ("adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis")
# names a planner had before: still accepted (`--dcp-planner dcp` says in one line what it is now)
OLD_NAMES = {"dcp": "cp-buckets", "dynamic_cp": "dynamic-cp"}

__all__ = ["PLANNERS", "PlannerBase", "PlanningError", "ReplicaType", "make_planner", "HydraulisPlanner"]


class HydraulisPlanner(AdaptivePlanner):
    """Hydraulis-style baseline: heterogeneous TP/PP replicas (no CP), candidate layouts
    and per-iteration choice like the adaptive planner, no recompute choice (none; full
    recompute only if no layout could otherwise hold a max-length sequence)."""

    name = "hydraulis"

    def __init__(self, model, cluster, max_seq_len, global_batch_tokens, length_sample=None, profile=None,
                 memory_margin=0.1, seed=0, progress=False, **kw):
        from dcp_ext.planning.cost_model import CostModel

        cm = CostModel(model, cluster, None, memory_margin)
        no_cp = [l for l in cm.all_layouts() if l.cp == 1]
        holds = any(make_type_table(cm, l, "off").max_doc >= max_seq_len for l in no_cp)
        kw.setdefault("recompute", "off" if holds else "full")
        kw.setdefault("layout_filter", lambda l: l.cp == 1)
        super().__init__(model, cluster, max_seq_len, global_batch_tokens, length_sample, profile, memory_margin, seed, progress, **kw)


def make_planner(
    name: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    max_seq_len: int,
    global_batch_tokens: int,
    length_sample: Sequence[int] | None = None,
    profile: Any = None,
    memory_margin: float = 0.1,
    seed: int = 0,
    progress: bool = False,
    **options: Any,
) -> PlannerBase:
    """A planner by name: "adaptive" | "static" | "dynamic-cp" | "cp-buckets" | "hydraulis"
    (or one of `OLD_NAMES`).

    length_sample: lengths from the dataset (any order), for the histogram the candidate
    layouts and the baselines' fixed settings are chosen from. profile: None, a Profile,
    or a path to a profile file (dcp-profile). memory_margin: fraction of device memory
    kept free. Extra keyword options go to the planner class.
    """
    key = name.strip().lower()
    key = OLD_NAMES.get(key, key)
    classes = {
        "adaptive": AdaptivePlanner,
        "static": StaticPlanner,
        "dynamic-cp": DynamicCPPlanner,
        "cp-buckets": CPBucketsPlanner,
        "hydraulis": HydraulisPlanner,
    }
    if key not in classes:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    return classes[key](
        model,
        cluster,
        max_seq_len,
        global_batch_tokens,
        length_sample,
        profile,
        memory_margin,
        seed,
        progress,
        **options,
    )

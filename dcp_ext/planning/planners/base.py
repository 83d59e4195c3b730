"""The planner interface the runtime and the CLIs call, and what all planners share.

Why it exists: `make_planner(name, ...)` must hand back objects that behave the same way
(replica types known at construction, one deterministic `IterationPlan` per call), so the
runtime can build its process groups once and the simulator can compare planners on the
same batches.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout, ReplicaType
from dcp_ext.planning.plan import IterationPlan, validate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec



class PlannerBase:
    name = "base"

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        max_seq_len: int,
        global_batch_tokens: int,
        length_sample: Sequence[int] | None = None,
        profile: Any = None,
        memory_margin: float = 0.1,
        seed: int = 0,
        progress: bool = False,
    ):
        from dcp_ext.planning.profile import load_profile

        self.model = model
        self.cluster = cluster
        self.max_seq_len = int(max_seq_len)
        self.global_batch_tokens = int(global_batch_tokens)
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.cm = CostModel(model, cluster, self.profile, memory_margin=memory_margin)
        self.seed = seed
        self.progress = progress
        if length_sample is None or len(length_sample) == 0:
            # without data: a flat histogram up to max_seq_len
            length_sample = list(np.unique(np.geomspace(16, self.max_seq_len, 64).round().astype(int)))
        self.length_sample = np.minimum(np.asarray(length_sample, dtype=np.int64), self.max_seq_len)
        self._types: list[ReplicaType] = []
        self.notes: dict[int, str] = {}  # iteration index -> a line for the log, left while planning (`explain`)

    # -------------------------------------------------------------- interface
    def replica_types(self) -> list[ReplicaType]:
        """Every replica type (layout on ranks) any plan of this planner can use."""
        return list(self._types)

    def plan_iteration(self, index: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        raise NotImplementedError

    def plan(self, index: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        """`plan_iteration` with its post-conditions checked: a valid plan of this world and
        model, whose every micro-batch fits device memory (less the margin) by the
        simulator's account. A planning bug is then a PlanningError, never an OOM."""
        return self.checked(self.plan_iteration(index, sample_ids, lengths), sample_ids, lengths)

    def checked(self, it: IterationPlan, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        """`it` if it is a valid plan of this world and model that fits device memory (`plan`'s
        post-conditions), else a PlanningError."""
        from dcp_ext.planning.planners.errors import PlanningError
        from dcp_ext.planning.simulator import simulate_iteration

        m = self.model
        validate_iteration(it, self.cluster.num_gpus, m.num_layers, m.num_attention_heads, m.num_query_groups)
        result = simulate_iteration(self.cm, it, dict(zip((int(i) for i in sample_ids), (int(n) for n in lengths))))
        if not result.memory_ok:
            raise PlanningError(f"iteration {it.index}: the plan needs {result.peak_memory_fraction:.0%} of device "
                                "memory, over the budget: raise --dcp-memory-margin headroom or report this planner bug")
        return it

    def describe(self) -> str:
        return self.name

    def explain(self, iteration: int, before, it: IterationPlan, lengths_of: dict) -> list[str]:
        """The log's lines about iteration `it` (`before`: the previous plan and its longest
        document, or None): why its layout differs from the previous one, and any note the
        planner left when it planned it (`notes`, e.g. a no-regret choice)."""
        from dcp_ext.planning.planners.explain import layout_change

        lines = [layout_change(iteration, before, it, lengths_of, self.model.num_layers, getattr(self, "tables", {}))]
        note = self.notes.pop(it.index, None)
        lines.append(f"> iteration {iteration}: {note}" if note else None)
        return [line for line in lines if line]

    def pool_line(self, iteration: int) -> str | None:
        """A line when the candidate pool was chosen again since the last call (None: not)."""
        return None

    def static_entry_in_pool(self) -> tuple[bool, int] | None:
        """(whether the launch line's static layout is one of the candidate mixes, how many
        candidates there are); None for a planner without a candidate pool."""
        return None

    def lower_bound_s(self, batches: Sequence[Sequence[int]]) -> float:
        """No plan of these batches (each a list of document lengths) is faster than this by
        the prices as calibrated now, over the layouts this planner prices, each iteration's
        fixed overhead included (`dcp_ext.planning.bound`). ValueError where none of those
        layouts holds a batch (a fixed planner's own layouts)."""
        from dcp_ext.planning.bound import lower_bound

        layouts = sorted(getattr(self, "tables", {}) or self.cm.all_layouts())
        return sum(lower_bound(self.cm, lengths, layouts) + self.cm.iteration_overhead_s for lengths in batches)

    def state_dict(self) -> dict:
        """What a resumed run needs to plan the next iterations exactly as an unbroken one
        (checkpointed with the model). Stateless planners: nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -------------------------------------------------------------- recalibration
    def calibrate_online(self, calibration) -> None:
        """Price with `calibration`'s corrections from now on (its windows fill as the
        run measures; `recalibrate` applies them)."""
        self.cm.calibration = calibration

    def recalibrate(self) -> bool:
        """Apply the measurements queued since the last call (between plans only: every
        rank must plan the next iteration from the same prices). True when prices changed."""
        cal = self.cm.calibration
        excess = cal.memory_excess if cal is not None else 0.0
        if cal is None or not cal.apply(self.cm):
            return False
        self.cm.recalibrated()
        if cal.memory_excess > excess:  # a new most: charge it (the tables are rebuilt there)
            self._charge_memory(cal)
        else:
            self._prices_changed()
        return True

    def charge_measured_memory(self, excess: float) -> None:
        """Charge `excess` bytes measured beyond the cost model outside a step (the runtime
        at rest, before training) as `recalibrate` charges a step's."""
        cal = self.cm.calibration
        if cal is None or excess <= cal.memory_excess:
            return
        cal.memory_excess = float(excess)
        self._charge_memory(cal)

    def _charge_memory(self, cal) -> None:
        """Reserve the memory measured beyond the cost model: all of it, or the most (by
        bisection) that still leaves every document the planner could place at start a place;
        the rest stays in --dcp-memory-margin. Deterministic: every rank charges the same."""
        lo, hi = cal.memory_reserve, cal.memory_excess
        cal.memory_reserve = hi
        self._prices_changed()
        if self._holds_longest():
            return
        for _ in range(10):
            mid = (lo + hi) / 2
            cal.memory_reserve = mid
            self._prices_changed()
            lo, hi = (mid, hi) if self._holds_longest() else (lo, mid)
        cal.memory_reserve = lo
        self._prices_changed()

    def _prices_changed(self) -> None:
        """Planners that cache prices (tables built at start) refresh them here."""

    def _holds_longest(self) -> bool:
        """Whether the planner can still plan every document it could at start, at the cost
        model's current capacity. Planners that do not say keep the start's capacity."""
        return False

    def planning_state(self) -> dict:
        """`state_dict` plus the calibration's windows: what a checkpoint keeps."""
        cal = self.cm.calibration
        return {**self.state_dict(), "calibration": cal.state_dict() if cal is not None else None}

    def load_planning_state(self, state: dict) -> None:
        self.load_state_dict(state)
        cal = self.cm.calibration
        if cal is not None and state.get("calibration"):
            cal.load_state_dict(state["calibration"], self.cm)
            self.cm.recalibrated()
            self._prices_changed()

    # -------------------------------------------------------------- helpers
    def _types_of(self, placements: Sequence[tuple[Layout, Sequence[int]]]) -> list[ReplicaType]:
        """The replica types of placed layouts (with their registered stage splits)."""
        out = []
        for lay, ranks in placements:
            split = self.cm.stage_splits.get(Layout(*lay)) if self.cm.stage_splits else None
            out.append(ReplicaType(lay.tp, lay.cp, lay.pp, tuple(int(r) for r in ranks), tuple(split) if split else None))
        return out

    def _register(self, placements: Sequence[tuple[Layout, Sequence[int]]]) -> None:
        seen = set(self._types)
        for key in self._types_of(placements):
            if key not in seen:
                seen.add(key)
                self._types.append(key)

    def _check_input(self, sample_ids: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
        if len(sample_ids) != len(lengths):
            raise ValueError(f"{len(sample_ids)} sample ids but {len(lengths)} lengths")
        s = np.asarray(lengths, dtype=np.int64)
        if len(s) and s.min() < 1:
            raise ValueError("sequence lengths must be >= 1")
        return s

"""The adaptive planner: per iteration, heterogeneous replicas, packing, recompute, accumulation.

Why it exists: this is the system's brain (docs/contracts.md step 2). Given one global batch it
returns the plan the runtime executes. It keeps what lasts over a run: the candidate pool
(searched at start with the static layout's entry, its shared buffers charged, chosen again
from measured prices) and the layout it runs now; the plan of one batch on that pool is
`planners.batch_plan` (steps 2-3 below), the v2 pass `planners.layer_plan`.

Per iteration:
  1. rank the candidate layouts (`dcp_ext.planning.planners.candidates`, built once per run) with the
     water-filling estimate: longest documents to the types that finish them fastest;
  2. plan the best ones in full (those within the estimate's accuracy of the best, and
     the current layout when staying on it is plausible). Stage 1: earliest finish time,
     longest document first, each document allowed on the type whose length range (from
     the estimate) holds it or on a more capable one; then single moves and pairwise swaps
     between the latest and the earliest replicas. Stage 2: each replica's share packed
     into micro-batches (first-fit-decreasing under the no-recompute token cap; a document
     longer than that runs alone with the fewest recomputed layers that hold it, which is
     DCP-intra; the number of micro-batches follows from the packing, DCP-inter; pipelines
     get as many as balance bubble against per-micro-batch cost, and every 1F1B window fits
     memory). The leading candidate is also planned with stage 1 by search (`side_plan`,
     where its kernel is built); the cheaper plan stays;
  3. price each full plan exactly (1F1B simulation + sync, the simulator's own numbers) and
     keep the best (within 0.2%, the one with more, smaller replicas); the layout changes
     only when the gain beats the switching cost plus a margin.

On CPU ranks memory is quadratic in document lengths (the attention keeps its
probabilities): there every "fits" above is the check of the micro-batch's padded
documents (`dcp_ext.planning.planners.doc_memory`), token caps are only upper bounds.

State: the current layout (for the switching rule) is the only state; calling with an
index that does not follow the previous one forgets it. Same calls, same plans.

The Hydraulis baseline is this planner restricted to cp == 1 and no recompute choice.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from dcp_ext.planning.layout import Layout, LayoutMix
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.planning.planners.base import PlannerBase
from dcp_ext.planning.planners.batch_plan import ChoiceRules, choose_plan, full_plan
from dcp_ext.planning.planners.batch_prep import BatchPrep, screen
from dcp_ext.planning.planners.candidates import Pool, build_pool, reserve_layouts, stderr_progress, with_static_entry
from dcp_ext.planning.planners.side_plan import enabled as side_plan_enabled
from dcp_ext.planning.batching import extreme_batches, sample_batches
from dcp_ext.planning.layout import canonical, describe, expand, mix_label, parse_layout, place
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import PackedReplica, to_iteration_plan
from dcp_ext.planning.planners.tables import make_type_table


def _switch(value, name: str, choices: tuple[str, ...]) -> str:
    """A feature option as one of `choices`: True/False read as "on"/"off"."""
    v = {True: "on", False: "off", None: "off"}.get(value, value) if isinstance(value, (bool, type(None))) else value
    v = str(v).strip().lower()
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (or True/False), not {value!r}")
    return v


class AdaptivePlanner(PlannerBase):
    name = "adaptive"

    def __init__(
        self,
        model,
        cluster,
        max_seq_len: int,
        global_batch_tokens: int,
        length_sample=None,
        profile=None,
        memory_margin: float = 0.1,
        seed: int = 0,
        progress: bool = False,
        *,
        layout_filter: Callable[[Layout], bool] | None = None,
        recompute: str = "any",
        max_layouts: int = 16,
        sample_count: int = 16,
        top_k: int = 2,
        switch_margin: float = 0.01,
        switch_cost_s: float = 0.0,
        max_moves: int | None = None,
        screen_slack: float = 0.01,
        side_plan: str = "auto",
        move_targets: int = 3,
        small_batch: int = 64,
        side_plan_max_docs: int = 8192,
        layouts: Sequence[str | Sequence[tuple[int, int, int]]] | None = None,
        static_layout: tuple[int, int, int] | None = None,
        layer_strategies: bool | str = False,
        uneven_stages: bool | str = False,
        rechoose_pool: bool = False,
    ):
        """static_layout (tp, cp, pp): the static baseline's layout (a Megatron line's
        parallel sizes), world // (tp*cp*pp) replicas of it, kept in the pool whatever the
        search finds, so the planner can always run what upstream Megatron would.

        layer_strategies (plan contract v2, default off): micro-batches may run layers under
        other re-factorings of their replica's tp*cp ranks (`planners.layer_plan`).
        uneven_stages (default off): pipelined layouts split their layers by the cost
        model's stage times (`planners.stage_split`), fixed per layout; "even" emits the
        even split explicitly (every stage priced on its own: the control for measuring
        what the balancing itself buys). Both: True/"on", False/"off".
        side_plan: "auto" plans the leading candidate a second time, its stage 1 by search
        (`planners.side_plan`), where that kernel is built; "on" always (the Python reference
        where it is not), "off" never.
        side_plan_max_docs: batches of more documents skip the side plan (a budget: at
        h200x1024 with 64M-token batches, 18k documents, it took 35 of 95 ms per iteration and
        never won).
        rechoose_pool (`--dcp-recalibration on`): the pool is chosen again from the
        recalibrated prices (`_rechoose`), among the reserve's layouts, whose replica
        types on every aligned block of ranks are registered at start."""
        super().__init__(model, cluster, max_seq_len, global_batch_tokens, length_sample, profile, memory_margin, seed, progress)
        self.layer_strategies = _switch(layer_strategies, "layer_strategies", ("on", "off"))
        self.uneven_stages = _switch(uneven_stages, "uneven_stages", ("on", "off", "even"))
        self.recompute = recompute
        self.top_k = top_k
        self.switch_margin = switch_margin
        self.switch_cost_s = switch_cost_s
        self.screen_slack = screen_slack
        self.move_targets = move_targets
        self.small_batch = small_batch
        self.side_plan_max_docs = side_plan_max_docs
        self._use_side_plan = side_plan_enabled(side_plan)
        self.max_moves = max_moves
        self.max_layouts = max_layouts
        self.rechoose_pool = bool(rechoose_pool) and layouts is None
        self.reserve: list[Layout] = []  # layouts a re-chosen pool may use (rechoose_pool)
        self._pool_stale = False  # the next plan chooses the pool again first
        self._current: LayoutMix | None = None
        self._regret_said = False  # the last no-regret line said a mix was set aside
        self._pool_said = None  # (pool_choices, pool) as `pool_line` last saw them
        self._recalibrations = 0
        self.pool_choices = 1  # times the pool was chosen (at start, then by `_rechoose`)
        allowed = [l for l in self.cm.all_layouts() if layout_filter is None or layout_filter(l)]
        if not allowed:
            raise PlanningError(f"no layout of {model.name} fits {cluster.name}")
        self.tables = {l: make_type_table(self.cm, l, recompute) for l in allowed}
        self.tables = {l: t for l, t in self.tables.items() if t.caps_alone and t.max_doc > 0}
        if layouts is not None:
            # a fixed pool (tests, demos): "2xtp2cp1pp1+..." strings or lists of (tp, cp, pp)
            fixed = [parse_layout(x) for x in layouts]
            for c in fixed:
                used = sum(l.size * n for l, n in c)
                if used != cluster.num_gpus:
                    raise ValueError(f"layout {describe(c)} uses {used} devices, the world has {cluster.num_gpus}")
                for l, _ in c:
                    if l not in self.tables:
                        raise ValueError(f"layout {describe(c)}: {l} is not valid for {model.name} on {cluster.name}")
            self.pool = Pool(fixed, sorted({l for c in fixed for l, _ in c}), np.zeros((len(fixed), 0)), fixed)
        else:
            self._pool_batches = (sample_batches(self.length_sample, self.global_batch_tokens, self.max_seq_len, sample_count, seed),
                                  extreme_batches(self.length_sample, self.global_batch_tokens, self.max_seq_len, seed))
            cb = stderr_progress(f"{self.name}: candidate layouts") if progress else None
            self.pool = self._search_pool(self.tables, self.max_seq_len, cb)
        self.static_entry: LayoutMix | None = None
        if static_layout is not None:
            self._add_static_entry(Layout(*static_layout), max_layouts, layout_filter)
        if self.uneven_stages != "off":
            from dcp_ext.planning.planners.stage_split import choose_stage_splits

            layouts = sorted({l for c in self.pool.layouts for l, _ in c})
            choose_stage_splits(self.cm, layouts, self.tables, self.length_sample, self.uneven_stages == "even")
        self._charge_pool_buffers(recompute)
        self._use_pool(self.pool)
        for c in self.pool.layouts:
            self._register(self.placements[c])
        for lay in self.reserve:
            self._register(self._aligned(lay))
        self._holdable = min(self.max_seq_len, max(t.max_doc for t in self.pool_tables.values()))
        self._last_index: int | None = None

    def _add_static_entry(self, lay: Layout, max_layouts: int, layout_filter) -> None:
        """The static layout's entry joins the pool (first), displacing the last entry the
        search chose when the pool is full, never the last one that holds a max-length sequence."""
        world = self.cluster.num_gpus
        if world % lay.size or (layout_filter is not None and not layout_filter(lay)):
            return  # not a layout of this planner (hydraulis has no cp): nothing to keep
        if lay not in self.tables:
            raise PlanningError(f"the static layout tp={lay.tp} pp={lay.pp} cp={lay.cp} cannot hold even a short "
                                f"sequence of {self.model.name} on {self.cluster.name}: raise "
                                "--tensor-model-parallel-size / --pipeline-model-parallel-size")
        self.static_entry = canonical({lay: world // lay.size})
        self.pool = with_static_entry(self.pool, self.static_entry, self.tables, self.max_seq_len, max_layouts)

    def _charge_pool_buffers(self, recompute: str) -> None:
        """A rank's stages share one buffer sized to the pool's largest stage: from now on
        every layout is charged that, and its tables are rebuilt. Charging a long-sequence
        layout (large tp·cp) for a short-sequence one's big stage can cost it the longest
        documents: then the entries using the largest stage leave the pool, until the pool
        holds again what it held alone (or one entry is left). The communicators of every
        registered replica type are charged too, and with `rechoose_pool` the reserve's
        layouts join at the same charge."""
        before = {l: self.tables[l] for c in self.pool.layouts for l, _ in c}
        need = min(self.max_seq_len, max(t.max_doc for t in before.values()))
        keep = list(range(len(self.pool.layouts)))
        while True:
            used = sorted({l for i in keep for l, _ in self.pool.layouts[i]})
            reserve = self._reserve_for(used)
            placements = [pl for i in keep for pl in place(expand(self.pool.layouts[i]), self.cluster.num_gpus)]
            placements += [pl for l in reserve for pl in self._aligned(l)]
            self.cm.charge_shared_buffers(sorted(set(used) | set(reserve)), placements)
            self.cm.charge_communicators(self._types_of(placements))
            tables = {l: make_type_table(self.cm, l, recompute) for l in sorted(set(used) | set(reserve))}
            tables = {l: t for l, t in tables.items() if t.caps_alone and t.max_doc > 0}
            fits = [i for i in keep if all(l in tables for l, _ in self.pool.layouts[i])]
            holdable = max((tables[l].max_doc for i in fits for l, _ in self.pool.layouts[i]), default=0)
            if fits and (holdable >= need or len(keep) == 1):
                break
            biggest = max(used, key=lambda l: self.model.local_stage_params(l.tp, l.pp))
            if self.static_entry is not None and any(l == biggest for l, _ in self.static_entry):
                break  # the static layout sets the buffers; dropping others would not help
            rest = [i for i in keep if all(l != biggest for l, _ in self.pool.layouts[i])]
            if not rest:
                break
            keep = rest
        if not fits:
            raise PlanningError(f"no layout of {self.model.name} fits {self.cluster.name} beside the shared "
                                f"parameter buffers of its pool ({self.cm.buffer_params / 1e9:.2f}B parameters)")
        self.tables = tables
        self.reserve = [l for l in reserve if l in tables]
        if len(fits) < len(self.pool.layouts):
            p = self.pool
            times = p.sample_times[fits] if len(p.sample_times) == len(p.layouts) else p.sample_times
            self.pool = Pool([p.layouts[i] for i in fits], p.types, times, p.considered)

    # ------------------------------------------------------------------ the pool again, from measured prices
    def _reserve_for(self, used: list[Layout]) -> list[Layout]:
        """With `rechoose_pool`: the pool's layouts, then those of the mixes the search
        considered (each batch's best, the one-type holders), at most `max_layouts`, none
        with a larger stage than the pool's (the shared buffers do not grow). Every one is
        registered on every aligned block of ranks, so any mix of them `place`s on
        registered types."""
        if not self.rechoose_pool:
            return []
        return reserve_layouts(self.cm, self.pool.considered, used, self.tables, self.max_layouts,
                               self.uneven_stages != "off")

    def _aligned(self, lay: Layout):
        """`lay` on every aligned block of ranks: world // size replicas of it, placed."""
        return place([lay] * (self.cluster.num_gpus // lay.size), self.cluster.num_gpus)

    def _registered(self, mix: LayoutMix) -> bool:
        """Whether every replica of `mix`, placed, is a type registered at start (ValueError
        when the mix does not fill this world)."""
        registered = set(self._types)
        return all(t in registered for t in self._types_of(place(expand(mix), self.cluster.num_gpus)))

    def _search_pool(self, tables: dict, longest: int, progress=None, refine: bool = True) -> Pool:
        """`build_pool` over `tables` for the sample batches, every batch's shortlist priced
        by this planner's full plan (`refine`: see build_pool)."""
        batches, extras = self._pool_batches
        self.placements = {}
        self.pool_tables = tables

        def exact(prep: BatchPrep, counts: LayoutMix) -> float:
            if counts not in self.placements:
                self.placements[counts] = place(expand(counts), self.cluster.num_gpus)
            t, order, bounds = screen(prep, counts)
            return max(r.time_s for r in self._full_plan(prep, counts, order, bounds))

        return build_pool(self.cm, tables, batches, longest, self.max_layouts, progress, extra_batches=extras, exact=exact,
                          refine=refine)

    def _use_pool(self, pool: Pool) -> None:
        self.pool = pool
        self.pool_tables = {l: self.tables[l] for c in pool.layouts for l, _ in c}
        self.placements = {c: place(expand(c), self.cluster.num_gpus) for c in pool.layouts}
        if self._current is not None and self._current not in pool.layouts:
            self._current = None

    def _rechoose(self) -> None:
        """Choose the pool again with the cost model's current (recalibrated) prices and
        memory, among the reserve's layouts; the static layout's entry stays first. Every
        mix places on replica types registered at start (checked: a PlanningError if not)."""
        tables = {l: t for l, t in self.tables.items() if l in self.reserve and t.caps_alone and t.max_doc > 0}
        longest = min(self._holdable, max(t.max_doc for t in tables.values()))
        pool = self._search_pool(tables, longest, refine=False)  # on the planning thread, beside the step
        if self.static_entry is not None:
            rest = [c for c in pool.layouts if c != self.static_entry][: max(0, self.max_layouts - 1)]
            pool = Pool([self.static_entry] + rest, pool.types, np.zeros((len(rest) + 1, 0)), pool.considered)
        for c in pool.layouts:
            if not self._registered(c):
                raise PlanningError(f"re-chosen pool entry {describe(c)} places on a replica type not registered at start")
        self._use_pool(pool)
        self.pool_choices += 1

    # ------------------------------------------------------------------ measured before committing
    def probe_layouts(self) -> list[Layout]:
        """The layouts the startup calibration measures: every layout a pool may use (the
        reserve with `rechoose_pool`, else the pool's), in a fixed order."""
        lays = self.reserve if self.rechoose_pool else sorted({l for c in self.pool.layouts for l, _ in c})
        return sorted(set(lays), key=lambda l: (l.size, l.tp, l.cp, l.pp))

    def probe_plan(self, index: int, layout: Layout, sample_ids: Sequence[int], lengths: Sequence[int],
                   every: int = 1) -> IterationPlan | None:
        """The batch, less the documents `layout` cannot hold, planned on world // size
        replicas of `layout` alone (placed on its registered blocks): an iteration the startup
        calibration runs to price `layout` on the job's own documents. `every` k: of the
        documents it holds, longest first, every k-th (the longest and a spread of the rest in
        1/k of the time). None when it holds none of them. The planner's state (current layout,
        pool) is not touched."""
        lay = Layout(*layout)
        table = self.tables.get(lay)
        if table is None:
            return None
        keep = [(int(i), int(n)) for i, n in zip(sample_ids, lengths) if 0 < int(n) <= table.max_doc]
        keep = sorted(keep, key=lambda x: (-x[1], x[0]))[:: max(1, int(every))]
        if not keep:
            return None
        ids = [i for i, _ in keep]
        s = self._check_input(ids, [n for _, n in keep])
        counts = canonical({lay: self.cluster.num_gpus // lay.size})
        saved = self.pool_tables, self.placements
        try:
            self.pool_tables = {**self.pool_tables, lay: table}
            self.placements = {**self.placements, counts: self._aligned(lay)}
            prep = BatchPrep(self.cm, self.pool_tables, s)
            t, order, bounds = screen(prep, counts)
            if not math.isfinite(t):
                return None
            reps = self._full_plan(prep, counts, order, bounds)
        finally:
            self.pool_tables, self.placements = saved
        return self.checked(to_iteration_plan(index, ids, reps, self.cm), ids, [n for _, n in keep])

    def choose_pool_now(self) -> None:
        """Choose the pool again from the current prices now (after the startup calibration);
        the re-choices while training then follow the 2nd, 8th, 32nd... recalibration from here."""
        if self.rechoose_pool:
            self._pool_stale = False
            self._recalibrations = 0
            self._rechoose()

    def recalibrate(self) -> bool:
        """Prices changed: with `rechoose_pool`, the next plan first chooses the pool again
        after the 2nd, 8th, 32nd... recalibration (and when charged memory costs the pool
        its longest documents)."""
        changed = super().recalibrate()
        if changed and self.rechoose_pool:
            self._recalibrations += 1
            n = self._recalibrations
            if n >= 2 and n & (n - 1) == 0 and n.bit_length() % 2 == 0:
                self._pool_stale = True
        return changed

    def _charge_memory(self, cal) -> None:
        super()._charge_memory(cal)
        if self.rechoose_pool and not self._pool_holds():
            self._pool_stale = True  # the pool lost the longest documents: the reserve has them

    def describe(self) -> str:
        return f"{self.name}: {len(self.pool.layouts)} layouts: " + "; ".join(describe(c) for c in self.pool.layouts)

    def static_entry_in_pool(self) -> tuple[bool, int]:
        entry = self.static_entry
        return entry is not None and entry in self.pool.layouts, len(self.pool.layouts)

    def pool_line(self, iteration: int) -> str | None:
        """One line each time the candidate pool was chosen again (from measured prices) since
        the last call; the first call only notes the pool it starts from."""
        now = [describe(c) for c in self.pool.layouts]
        said, self._pool_said = self._pool_said, (self.pool_choices, now)
        if said is None or said[0] == self.pool_choices:
            return None
        what = "the same pool" if now == said[1] else "; ".join(now)
        return f"iteration {iteration + 1}: candidate pool chosen again from the measured prices: {what}"

    def reset(self) -> None:
        self._current = None
        self._last_index = None

    def _prices_changed(self) -> None:
        # the tables' times (micro-batch constant, sync) follow the prices; memory caps do not move
        self.tables = {l: make_type_table(self.cm, l, self.recompute) for l in self.tables}
        self.pool_tables = {l: self.tables[l] for l in self.pool_tables}

    def _holds_longest(self) -> bool:
        """Every layout of the pool still holds a document alone, and the pool the longest it
        held at start; with `rechoose_pool`, some layout of the reserve holds that longest
        (the pool is chosen again among them before the next plan)."""
        if self.rechoose_pool:
            return any(t.caps_alone and t.max_doc >= self._holdable for t in self.tables.values())
        return self._pool_holds()

    def _pool_holds(self) -> bool:
        tables = self.pool_tables.values()
        return all(t.caps_alone and t.max_doc > 0 for t in tables) and max(t.max_doc for t in tables) >= self._holdable

    def state_dict(self) -> dict:
        """The layout the switching rule stays with, as its place in the pool (and the pool,
        which a run on another cluster does not share); with `rechoose_pool` the pool is
        taken back as saved (it may have been chosen again), with the re-choice schedule."""
        current = None if self._current is None else self.pool.layouts.index(self._current)
        out = {"current": current, "last_index": self._last_index, "pool": [describe(c) for c in self.pool.layouts]}
        if self.rechoose_pool:
            out.update(recalibrations=self._recalibrations, pool_stale=self._pool_stale)
        return out

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("pool")
        if self.rechoose_pool and "recalibrations" in state and saved:
            try:
                mixes = [parse_layout(c) for c in saved]
                ok = all(self._registered(c) for c in mixes)
            except ValueError:  # not a mix of this world
                mixes, ok = [], False
            if mixes and ok:
                self._use_pool(Pool(mixes, self.pool.types, np.zeros((len(mixes), 0)), self.pool.considered))
                self._recalibrations = int(state["recalibrations"])
                self._pool_stale = bool(state.get("pool_stale"))
        if saved != [describe(c) for c in self.pool.layouts]:
            self.reset()  # another pool (world size, model, data): nothing to stay with
            return
        current = state.get("current")
        self._current = None if current is None else self.pool.layouts[current]
        self._last_index = state.get("last_index")

    # ------------------------------------------------------------------ per iteration
    def plan_iteration(self, index: int, sample_ids: Sequence[int], lengths: Sequence[int]) -> IterationPlan:
        s = self._check_input(sample_ids, lengths)
        if self._pool_stale:
            self._pool_stale = False
            self._rechoose()
        if self._last_index is not None and index != self._last_index + 1:
            self._current = None  # not the next iteration: no layout to stay with
        self._last_index = index
        longest = int(s.max()) if len(s) else 0
        holdable = max(t.max_doc for t in self.pool_tables.values())
        if longest > holdable:
            raise PlanningError(f"a sequence of {longest} tokens fits no candidate layout; the longest that fits is {int(holdable)} tokens")
        prep = BatchPrep(self.cm, self.pool_tables, s)
        choice = choose_plan(self.cm, self.pool_tables, self.placements, prep, self.pool.layouts, self._current,
                             self.mix_factor, self._rules(), longest)
        plans, best, weight = choice.plans, choice.best, choice.weight
        self._note_regret(index, plans, best, weight)
        self._current = self.pool.layouts[best]
        # the plan contract v2 pass (layer strategies, uneven stages) on the chosen plan only:
        # it never makes a replica slower, and the choice above stays the v1 planner's
        reps = plans[best][1]
        if self.layer_strategies == "on" or self.cm.stage_splits:
            from dcp_ext.planning.planners.layer_plan import v2_pass

            reps = v2_pass(self.cm, self.pool_tables, reps, prep.s_list, self.layer_strategies == "on")
        return to_iteration_plan(index, sample_ids, reps, self.cm)

    @property
    def mix_factor(self) -> float:
        """The calibration's weight on plans that mix layouts (1.0 without online calibration)."""
        cal = self.cm.calibration
        return cal.mix_factor if cal is not None and cal.observed else 1.0

    def _note_regret(self, index: int, plans: dict, best: int, weight: list[float]) -> None:
        """When what mixes measured turns the choice from a mix to one layout (or back), one
        line for the log (`notes[index]`), said when the state changes, not every iteration."""
        unweighted = min(plans, key=lambda i: (plans[i][0] / weight[i], i))
        turned = weight[unweighted] > 1.0 and len(self.pool.layouts[unweighted]) > 1 and len(self.pool.layouts[best]) == 1
        if turned == self._regret_said:
            return
        self._regret_said = turned
        mix, single = mix_label(self.pool.layouts[unweighted]), mix_label(self.pool.layouts[best])
        if turned:
            self.notes[index] = (f"no regret: mixed layouts measured x{self.mix_factor:.2f} their predicted time against "
                                 f"single layouts; {single} runs instead of {mix} (priced "
                                 f"{plans[unweighted][0] / weight[unweighted] * 1000:.0f} ms unweighted, "
                                 f"{plans[best][0] * 1000:.0f} ms)")

    # ------------------------------------------------------------------ one layout in full
    def _full_plan(self, prep: BatchPrep, counts: LayoutMix, order, bounds: list[int]) -> list[PackedReplica]:
        return full_plan(self.cm, self.pool_tables, self.placements[counts], prep, counts, order, bounds,
                         self.move_targets, self.max_moves)

    def _rules(self) -> ChoiceRules:
        return ChoiceRules(top_k=self.top_k, screen_slack=self.screen_slack, switch_margin=self.switch_margin,
                           switch_cost_s=self.switch_cost_s, small_batch=self.small_batch,
                           move_targets=self.move_targets, max_moves=self.max_moves,
                           use_side_plan=self._use_side_plan, side_plan_max_docs=self.side_plan_max_docs,
                           seed=self.seed)

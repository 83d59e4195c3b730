"""The plan of one batch is a pure function of the pool, the tables and the current layout
(`planners.batch_plan`, split out of the adaptive planner, issue 39).

Why it exists: the planner keeps the pool and the layout it runs; given those, choosing a
batch's plan must not depend on anything else, or the same batch could plan differently.
Checked against the planner itself: the choice `choose_plan` makes from the planner's state
is the layout the planner then runs, the same call twice gives the same plans, and it
leaves the planner's state as it found it; the switching rule keeps the current layout
when switching gains less than the margin.
"""
import dataclasses

import numpy as np

from dcp_ext.planning.batching import global_batches
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.planners.batch_plan import choose_plan
from dcp_ext.planning.planners.batch_prep import BatchPrep
from dcp_ext.planning.specs import ClusterSpec, ModelSpec


def _planner_and_batches():
    model, cluster = ModelSpec.from_preset("demo"), ClusterSpec.cpu_gloo(4)
    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(7.2, 1.3, 4000).astype(np.int64) + 5, 2048)
    p = make_planner("adaptive", model, cluster, max_seq_len=2048, global_batch_tokens=8192, length_sample=lengths)
    return p, lengths, global_batches(lengths.tolist(), 8192, 2048, count=6)


def _choose(p, lengths, ids, current, **rules):
    s = p._check_input(ids, lengths[ids].tolist())
    prep = BatchPrep(p.cm, p.pool_tables, s)
    r = dataclasses.replace(p._rules(), **rules)
    return choose_plan(p.cm, p.pool_tables, p.placements, prep, p.pool.layouts, current, p.mix_factor, r,
                       int(s.max()))


def test_the_planner_runs_what_the_batch_plan_chooses_and_the_choice_is_pure():
    p, lengths, batches = _planner_and_batches()
    assert len(p.pool.layouts) > 1  # a choice to make
    for i, ids in enumerate(batches):
        current = p._current
        first = _choose(p, lengths, ids, current)
        again = _choose(p, lengths, ids, current)
        assert again.best == first.best and again.plans.keys() == first.plans.keys()
        assert [again.plans[k][0] for k in again.plans] == [first.plans[k][0] for k in first.plans]
        assert p._current is current  # choosing touched no state
        it = p.plan_iteration(i, ids, lengths[ids].tolist())
        assert p._current == p.pool.layouts[first.best]
        assert it.predicted_time_s > 0


def test_the_current_layout_stays_unless_switching_pays():
    p, lengths, batches = _planner_and_batches()
    ids = batches[0]
    free = _choose(p, lengths, ids, None, small_batch=10**9)  # every entry planned in full
    times = {k: v[0] for k, v in free.plans.items()}
    worst = max(times, key=times.get)
    assert times[worst] > times[free.best]  # another entry is slower
    current = p.pool.layouts[worst]
    gain = (times[worst] - times[free.best]) / times[worst]
    stay = _choose(p, lengths, ids, current, small_batch=10**9, switch_margin=gain * 1.01)
    move = _choose(p, lengths, ids, current, small_batch=10**9, switch_margin=gain * 0.5)
    assert stay.best == worst and move.best != worst

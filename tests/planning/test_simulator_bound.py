"""The pipeline part of the lower bound (`dcp_ext.planning.bound`): the 1F1B path inequality it rests
on, the exact capacity it derives, and no single-replica plan (any packing, order and
recompute, memory-valid) ever beating it, with and without context parallelism."""
import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from dcp_ext.planning.bound import bound_tables, capacity, lower_bound
from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
from dcp_ext.planning.planners.errors import PlanningError
from dcp_ext.planning.planners.packing import fit_memory
from dcp_ext.planning.planners.tables import make_type_table
from dcp_ext.planning.simulator import one_f_one_b, simulate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec


def test_1f1b_path_inequality():
    """M >= W + (pp-1)(f_i + b_k) - sum_{i-pp<l<i} b_l - sum_{k<l<k+pp} f_l for all i <= k,
    and its average over k (what the bound uses), on the simulator's own 1F1B."""
    rng = random.Random(11)
    for _ in range(3000):
        pp = rng.choice([2, 3, 4, 5, 8])
        m = rng.randint(1, 12)
        f = [rng.choice([rng.uniform(0.01, 0.1), rng.uniform(0.1, 3), rng.uniform(1, 10)]) for _ in range(m)]
        b = [x * rng.uniform(0.3, 3.5) for x in f]
        M = one_f_one_b(f, b, pp).makespan
        W = sum(f) + sum(b)
        for i, k in itertools.combinations_with_replacement(range(m), 2):
            lb = W + (pp - 1) * (f[i] + b[k]) - sum(b[max(0, i - pp + 1):i]) - sum(f[k + 1:k + pp])
            assert M >= lb - 1e-9 * M, (pp, m, i, k)
        assert M >= W + (pp - 1) * (f[0] + (sum(b) - sum(f)) / m) - 1e-9 * M


def _feasible(X, m, room, psi, q, c0, c0fb, cv, gamma):
    return X + m * c0 + q * max(c0fb, psi, cv + gamma * X / m) <= room


@pytest.mark.parametrize("seed", range(4))
def test_capacity_is_the_largest_feasible_work(seed):
    """theta 0: capacity = max X such that some m >= 1 satisfies the replica inequality
    (checked against a dense search over m, integer and real)."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        q = int(rng.integers(1, 8))
        c0 = float(rng.uniform(1e-3, 0.05))
        c0fb = c0 * float(rng.uniform(0.8, 1.0))
        cv = c0 * float(rng.uniform(0.1, 0.9))
        gamma = float(rng.uniform(0.05, 0.6))
        psi = float(rng.choice([-np.inf, rng.uniform(0, 0.5)]))
        room = float(rng.uniform(0.05, 5.0))
        cap = float(capacity(room, psi, q, c0, c0fb, cv, gamma, 0.0))
        ms = np.concatenate([np.arange(1, 4000), np.geomspace(1, 4000, 3000)])
        if cap <= 0:
            assert not any(_feasible(1e-9, m, room, psi, q, c0, c0fb, cv, gamma) for m in ms[:50])
            continue
        over = cap * (1 + 1e-6) + 1e-12
        assert not any(_feasible(over, m, room, psi, q, c0, c0fb, cv, gamma) for m in ms)
        under = cap * (1 - 1e-3)
        assert any(_feasible(under, m, room, psi, q, c0, c0fb, cv, gamma) for m in ms)


CASES = [
    ("demo", ClusterSpec.cpu_gloo(4), (1, 1, 4), 2048),
    ("demo", ClusterSpec.cpu_gloo(4), (1, 2, 2), 2048),
    ("demo", ClusterSpec.cpu_gloo(4), (2, 1, 2), 2048),
    ("demo", ClusterSpec.cpu_gloo(2).with_(memory_bytes=0.12e9, reserved_bytes=0.0), (1, 1, 2), 2048),
    ("llama2-7b", ClusterSpec.from_preset("h200x8"), (2, 2, 2), 65536),
    ("llama2-7b", ClusterSpec.from_preset("h200x8"), (1, 4, 2), 65536),
    ("llama2-7b", ClusterSpec.from_preset("h200x8"), (1, 1, 8), 32768),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_no_single_pipeline_replica_beats_the_bound(data):
    """One pipeline replica fills the world: any split into micro-batches, any order, any
    extra recompute (raised where 1F1B memory needs it) simulates at or above the bound
    restricted to that layout; the bound over all layouts is lower still."""
    name, cluster, lay, max_len = data.draw(st.sampled_from(CASES))
    cm = CostModel(ModelSpec.from_preset(name), cluster)
    lay = Layout(*lay)
    tt = make_type_table(cm, lay, "any")
    big = data.draw(st.booleans())
    hi = max_len if big else max(64, max_len // 16)
    lengths = data.draw(st.lists(st.integers(1, min(hi, int(tt.max_doc))), min_size=1, max_size=24))
    n = len(lengths)
    m = data.draw(st.integers(1, n))
    which = data.draw(st.lists(st.integers(0, m - 1), min_size=n, max_size=n))
    groups = [[d for d in range(n) if which[d] == g] for g in range(m)]
    groups = [g for g in groups if g]
    order = data.draw(st.permutations(list(range(len(groups)))))
    extra = data.draw(st.lists(st.integers(0, cm.layers_per_stage(lay)), min_size=len(groups), max_size=len(groups)))
    s = np.asarray(lengths)
    mbs = []
    for gi, e in zip(order, extra):
        g = groups[gi]
        rs = tt.rs_for(float(s[g].sum()))
        assume(rs is not None)
        mbs.append((g, min(cm.layers_per_stage(lay), max(rs, e))))
    try:
        mbs, _ = fit_memory(cm, tt, s, mbs)
    except PlanningError:
        assume(False)
    rep = ReplicaPlan(list(range(lay.size)), lay.tp, lay.cp, lay.pp,
                      [MicroBatchPlan(list(g), cm.recompute_layers(lay, rs)) for g, rs in mbs])
    it = IterationPlan(0, list(range(n)), [rep])
    res = simulate_iteration(cm, it, dict(enumerate(lengths)))
    assume(res.memory_ok)
    lb_one = lower_bound(cm, lengths, layouts=[lay])
    assert res.time_s >= lb_one * (1 - 1e-9), (res.time_s, lb_one)
    assert lower_bound(cm, lengths) <= lb_one * (1 + 1e-9)


def test_pipeline_bubble_tightens_the_bound_where_pipelines_look_cheap():
    """On 256 GPUs pipelines halve the sync; without their bubble the relaxation favours
    them, with it the bound rises (and stays below what the planners reach, which
    tests/planning/test_planner.py checks on real batches)."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(7.2, 1.3, 1200).astype(int) + 5, 131072).tolist()
    cm = CostModel(ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset("h200x256"))
    tb = bound_tables(cm, lengths)
    weak = lower_bound(cm, lengths, tables=tb, pipeline=False)
    strong = lower_bound(cm, lengths, tables=tb)
    assert strong > 1.03 * weak

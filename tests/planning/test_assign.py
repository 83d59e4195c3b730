"""Properties of the assignment kernels (stage 1, stage 2, full plan, baselines), run on
both implementations, and C++ == Python on random inputs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_ext.assign import (BASELINES, ReplicaCost, balance, baseline_plan, cpp_available, estimate, pack,
                            plan_replicas, replica_time, seq_cost)
from tests.support.assign_strategies import IMPLS, instances, replica_costs

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _estimate(rc: ReplicaCost, lens) -> float:
    lens = sorted(lens, reverse=True)
    if not lens:
        return 0.0
    p = rc.as_tuple()
    W = 0.0
    for s in lens:
        W += seq_cost(p, s)
    return estimate(p, W, sum(lens), seq_cost(p, lens[0]), len(lens))


def _check_plan(lengths, replicas, res):
    n, R = len(lengths), len(replicas)
    seen = [i for rmbs in res.micro_batches for mb in rmbs for i in mb]
    assert sorted(seen) == list(range(n)), "every sequence in exactly one micro-batch"
    assert len(res.micro_batches) == R
    for r, (rc, rmbs) in enumerate(zip(replicas, res.micro_batches)):
        for mb in rmbs:
            assert mb, "no empty micro-batch"
            assert sum(lengths[i] for i in mb) <= rc.max_mb_tokens
            assert all(lengths[i] <= rc.max_seq_len for i in mb)
            assert all(res.assignment[i] == r for i in mb)
        assert res.replica_times[r] == pytest.approx(replica_time(lengths, rmbs, rc), rel=1e-12, abs=1e-15)
    assert res.makespan == pytest.approx(max(res.replica_times.tolist() + [0.0]))


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(inst=instances())
def test_balance_properties(impl, inst):
    lengths, replicas = inst
    res = balance(lengths, replicas, impl=impl)
    start = balance(lengths, replicas, impl=impl, restarts=0, local_search=False, starts=1)
    n = len(lengths)
    assert res.assignment.shape == (n,) and res.assignment.dtype == np.int64
    assert all(0 <= r < len(replicas) for r in res.assignment.tolist())
    for i, r in enumerate(res.assignment.tolist()):
        assert lengths[i] <= replicas[r].seq_cap, "capacity respected"
    for r, rc in enumerate(replicas):  # replica_times are the estimates of the returned assignment
        mine = [lengths[i] for i in range(n) if res.assignment[i] == r]
        assert res.replica_times[r] == pytest.approx(_estimate(rc, mine), rel=1e-9, abs=1e-15)
    assert res.makespan == pytest.approx(float(res.replica_times.max()))
    assert res.makespan <= start.makespan * (1 + 1e-12), "never worse than the greedy start"
    assert res.greedy_makespan == start.makespan


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(rc=replica_costs(), data=st.data())
def test_pack_properties(impl, rc, data):
    lengths = data.draw(st.lists(st.integers(1, rc.seq_cap), max_size=40))
    mbs = pack(lengths, rc, impl=impl)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        assert mb == sorted(mb) and mb
        assert sum(lengths[i] for i in mb) <= rc.max_mb_tokens
    t = replica_time(lengths, mbs, rc)
    assert t >= _estimate(rc, lengths) * (1 - 1e-12), "the stage-1 estimate is a lower bound"
    start = pack(lengths, rc, impl=impl, restarts=0, ls_budget=0)
    assert t <= replica_time(lengths, start, rc) * (1 + 1e-12), "never worse than the greedy start"


@pytest.mark.parametrize("impl", IMPLS)
@FAST
@given(inst=instances())
def test_plan_properties(impl, inst):
    lengths, replicas = inst
    res = plan_replicas(lengths, replicas, impl=impl)
    _check_plan(lengths, replicas, res)
    assert np.all(res.replica_times >= res.estimates * (1 - 1e-12))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", BASELINES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances())
def test_baselines_valid(impl, name, inst):
    lengths, replicas = inst
    _check_plan(lengths, replicas, baseline_plan(name, lengths, replicas, impl=impl))


@pytest.mark.skipif(not cpp_available(), reason="C++ extension not built")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), seed=st.integers(0, 2**64 - 1))
def test_cpp_equals_python(inst, seed):
    lengths, replicas = inst
    a = balance(lengths, replicas, seed=seed, impl="cpp")
    b = balance(lengths, replicas, seed=seed, impl="python")
    assert a.assignment.tolist() == b.assignment.tolist()
    assert a.replica_times.tolist() == b.replica_times.tolist()  # bit for bit
    assert (a.makespan, a.greedy_makespan) == (b.makespan, b.greedy_makespan)
    pa = plan_replicas(lengths, replicas, seed=seed, impl="cpp")
    pb = plan_replicas(lengths, replicas, seed=seed, impl="python")
    assert pa.micro_batches == pb.micro_batches
    assert pa.replica_times.tolist() == pb.replica_times.tolist()
    for name in BASELINES:
        assert (baseline_plan(name, lengths, replicas, seed=seed, impl="cpp").micro_batches
                == baseline_plan(name, lengths, replicas, seed=seed, impl="python").micro_batches)
    rc = replicas[0]
    fit = [s for s in lengths if s <= rc.seq_cap]
    assert pack(fit, rc, seed=seed, impl="cpp", restarts=2) == pack(fit, rc, seed=seed, impl="python", restarts=2)


@pytest.mark.skipif(not cpp_available(), reason="C++ extension not built")
def test_cpp_equals_python_real_lengths(real_lengths):
    """A larger input from the real data: 300 sequences on heterogeneous replicas."""
    lengths = np.minimum(real_lengths[:300], 32768)
    replicas = [ReplicaCost(2e-9, 1e-5, 1e-4, 4e-3, 1, 8192, 8192)] * 3 + \
               [ReplicaCost(5e-10, 3e-6, 1e-4, 4e-3, 2, 32768, 32768)] * 2
    a = plan_replicas(lengths, replicas, impl="cpp")
    b = plan_replicas(lengths, replicas, impl="python")
    assert a.micro_batches == b.micro_batches and a.replica_times.tolist() == b.replica_times.tolist()


@pytest.fixture(scope="module")
def real_lengths():
    from dcp_ext.data.lengths import lengths_path

    path = lengths_path("code_python_cl100k.txt")
    return np.loadtxt(path, dtype=np.int64)


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_as_numpy_and_lists_agree(impl):
    lengths = [300, 5, 4000, 1200, 77, 2048, 2048, 9]
    replicas = [ReplicaCost(1e-8, 1e-5, 1e-4, 2e-3, 2, 4096, 4096), ReplicaCost(1e-8, 2e-5, 1e-4, 2e-3, 1, 2048, 4096)]
    a = plan_replicas(lengths, replicas, impl=impl)
    b = plan_replicas(np.array(lengths, dtype=np.int32), tuple(replicas), impl=impl)
    assert a.micro_batches == b.micro_batches
    _check_plan(lengths, replicas, a)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_and_single_replica(impl):
    rc = ReplicaCost(1e-8, 1e-5, 1e-4, 2e-3, 2, 4096, 4096)
    res = plan_replicas([], [rc, rc], impl=impl)
    assert res.makespan == 0.0 and res.micro_batches == [[], []]
    assert pack([], rc, impl=impl) == []
    one = plan_replicas([10, 20, 30], [rc], impl=impl)
    assert one.assignment.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_long_sequences_go_where_they_fit(impl):
    short = ReplicaCost(1e-9, 1e-6, 0.0, 1e-3, 1, 1000, 1000)
    long = ReplicaCost(1e-9, 1e-4, 0.0, 1e-3, 1, 10000, 10000)  # 100x slower per token
    lengths = [5000, 6000] + [100] * 30
    res = balance(lengths, [short, long], impl=impl)
    assert res.assignment[0] == 1 and res.assignment[1] == 1
    assert all(r == 0 for r in res.assignment[2:].tolist()), "short ones avoid the slow replica"


@pytest.mark.parametrize("impl", IMPLS)
def test_balances_identical_replicas(impl):
    rc = ReplicaCost(0.0, 1.0, 0.0, 0.0, 1, 100, 10**6)
    res = balance([10] * 12, [rc] * 4, impl=impl)  # 12 equal jobs on 4 machines: 3 each
    assert np.bincount(res.assignment, minlength=4).tolist() == [3, 3, 3, 3]
    assert res.makespan == 30.0


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_uses_more_micro_batches_with_pipeline(impl):
    """pp > 1 pays (pp-1) * largest micro-batch: splitting helps when overhead is small."""
    lengths = [1000] * 8
    flat = ReplicaCost(0.0, 1e-3, 0.0, 1e-3, 1, 8000, 8000)
    deep = ReplicaCost(0.0, 1e-3, 0.0, 1e-3, 8, 8000, 8000)
    assert len(pack(lengths, flat, impl=impl)) == 1
    assert len(pack(lengths, deep, impl=impl)) == 8
    assert replica_time(lengths, pack(lengths, deep, impl=impl), deep) == pytest.approx(8 * 1.001 + 7 * 1.001)


@pytest.mark.parametrize("impl", IMPLS)
def test_seed_changes_only_search_not_validity(impl):
    lengths = list(range(100, 2100, 50))
    replicas = [ReplicaCost(1e-9, 1e-5, 1e-4, 2e-3, pp, 4096, 4096) for pp in (1, 2, 1)]
    for seed in (0, 1, 12345):
        _check_plan(lengths, replicas, plan_replicas(lengths, replicas, seed=seed, impl=impl))
    a = plan_replicas(lengths, replicas, seed=7, impl=impl)
    b = plan_replicas(lengths, replicas, seed=7, impl=impl)
    assert a.micro_batches == b.micro_batches, "deterministic for a seed"

"""The cost model shared by every kernel: replica_time, the stage-1 estimate, the RNG."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ext.assign import ReplicaCost, estimate, replica_time, seq_cost
from dcp_ext.assign.rng import SplitMix64
from tests.support.assign_strategies import replica_costs


def test_replica_time_by_hand():
    rc = ReplicaCost(a=1e-6, b=1e-3, c=0.01, mb_overhead=0.1, pp=3, max_seq_len=100, max_mb_tokens=100)
    lengths = [10, 20, 30]
    # costs: 10 -> 1e-4+0.01+0.01 = 0.0201; 20 -> 4e-4+0.02+0.01 = 0.0304; 30 -> 9e-4+0.03+0.01 = 0.0409
    mbs = [[0, 1], [2], []]
    mb0, mb1 = 0.1 + 0.0201 + 0.0304, 0.1 + 0.0409
    assert replica_time(lengths, mbs, rc) == pytest.approx(mb0 + mb1 + 2 * mb0)
    assert replica_time(lengths, [], rc) == 0.0


def _costs(rc, lens):
    p = rc.as_tuple()
    return [seq_cost(p, s) for s in lens]


@settings(max_examples=60, deadline=None)
@given(rc=replica_costs(), data=st.data())
def test_estimate_is_a_lower_bound_of_any_packing(rc, data):
    lens = data.draw(st.lists(st.integers(1, rc.seq_cap), min_size=1, max_size=25))
    # a random valid packing: next fit over a random order
    order = data.draw(st.permutations(range(len(lens))))
    mbs, cur, tok = [], [], 0
    for i in order:
        if cur and (tok + lens[i] > rc.max_mb_tokens or data.draw(st.booleans())):
            mbs.append(cur)
            cur, tok = [], 0
        cur.append(i)
        tok += lens[i]
    mbs.append(cur)
    desc = sorted(lens, reverse=True)
    p = rc.as_tuple()
    W = 0.0
    for s in desc:
        W += seq_cost(p, s)
    est = estimate(p, W, sum(lens), seq_cost(p, desc[0]), len(lens))
    assert est <= replica_time(lens, mbs, rc) * (1 + 1e-12) + 1e-15


def test_estimate_values():
    rc = ReplicaCost(0.0, 1.0, 0.0, 1.0, 1, 10, 10)  # cost = tokens; pp 1: W + o*ceil(T/cap)
    p = rc.as_tuple()
    assert estimate(p, 25.0, 25, 9.0, 4) == 25.0 + 3.0
    assert estimate(p, 0.0, 0, 0.0, 0) == 0.0
    deep = ReplicaCost(0.0, 1.0, 0.0, 1.0, 5, 1000, 1000).as_tuple()  # q = 4: v* = sqrt(4*100/1) = 20
    # 100 sequences of cost 1: W + q*o + min_v v*o + q*max(100/v, 1) at v = 20: 100 + 4 + 20 + 20
    assert estimate(deep, 100.0, 100, 1.0, 100) == 144.0
    # only 10 sequences: v <= 10 and max(W/v, m) >= m = 10
    assert estimate(deep, 100.0, 100, 10.0, 10) == 100 + 4 + min(v + 4 * max(100 / v, 10) for v in range(1, 11))


@settings(max_examples=60, deadline=None)
@given(rc=replica_costs(), data=st.data())
def test_estimate_is_monotone(rc, data):
    """Adding a sequence never lowers the estimate (local search relies on it)."""
    lens = data.draw(st.lists(st.integers(1, rc.seq_cap), min_size=1, max_size=20))
    p = rc.as_tuple()

    def est(ls):
        ls = sorted(ls, reverse=True)
        W = 0.0
        for s in ls:
            W += seq_cost(p, s)
        return estimate(p, W, sum(ls), seq_cost(p, ls[0]), len(ls))

    assert est(lens) >= est(lens[:-1]) * (1 - 1e-12) if len(lens) > 1 else est(lens) >= 0.0


def test_splitmix64_reference_values():
    g = SplitMix64(0)
    assert g.next_u64() == 0xE220A8397B1DCDAF  # published first output for seed 0
    assert g.next_u64() == 0x6E789E6AA1B965F4
    assert 0.0 <= SplitMix64(1).next_double() < 1.0
    items = list(range(10))
    SplitMix64(3).shuffle(items)
    assert sorted(items) == list(range(10)) and items != list(range(10))
    assert not math.isnan(SplitMix64(2**64 - 1).next_double())

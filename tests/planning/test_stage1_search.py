"""Stage 1 by search (planners/stage1_search.py, csrc/stage1_search.cpp): the side plan's
assignment of documents to replicas.

The kernel must equal its Python reference bit for bit (the side plan's result must not
depend on whether the extension is built), and the search must do what stage 1's greedy
cannot: even out a batch the greedy leaves uneven, within every replica's caps.
"""
import numpy as np
import pytest

from dcp_ext.kernels import kernel
from dcp_ext.planning.planners import stage1_search as S


def random_instance(rng):
    n = int(rng.integers(0, 60))
    kinds = []
    for _ in range(int(rng.integers(1, 3))):
        cap = int(rng.integers(3000, 20000))
        longest = int(rng.integers(2000, cap + 1))
        kinds.append(S.ReplicaCost(float(rng.uniform(1e-9, 1e-7)), float(rng.uniform(1e-5, 1e-4)),
                                   float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 1e-2)),
                                   int(rng.choice([1, 1, 2, 4])), longest, cap))
    replicas = [kinds[int(rng.integers(0, len(kinds)))] for _ in range(int(rng.integers(1, 7)))]
    room = max(min(r.longest, r.cap) for r in replicas)
    lengths = rng.integers(1, room + 1, n).astype(np.int64)
    return lengths, replicas, int(rng.integers(0, 2**63))


def largest_estimate(lengths, replicas, assignment) -> float:
    st = S.State([tuple(r) for r in replicas])
    for i, r in enumerate(assignment):
        st.mem[r].append((-int(lengths[i]), i))
    for m in st.mem:
        m.sort()
    st.recompute()
    return max(st.est)


def test_kernel_equals_reference():
    run = kernel("stage1_search")
    if run is None:
        pytest.skip("the C++ kernels are not built")
    rng = np.random.default_rng(7)
    for _ in range(30):
        lengths, replicas, seed = random_instance(rng)
        n = len(lengths)
        params = [tuple(r) for r in replicas]
        want = S.reference(lengths.tolist(), params, seed, S.restarts_for(n), S.budget_for(n))
        assert list(run(lengths, params, seed, S.restarts_for(n), S.budget_for(n))) == want


def test_within_caps_and_never_worse_than_greedy():
    rng = np.random.default_rng(11)
    for _ in range(30):
        lengths, replicas, seed = random_instance(rng)
        got = S.search(lengths, replicas, seed)
        assert len(got) == len(lengths)
        for i, r in enumerate(got):
            assert lengths[i] <= min(replicas[r].longest, replicas[r].cap)
        if len(lengths):
            greedy = S.reference(lengths.tolist(), [tuple(r) for r in replicas], seed, restarts=0, budget=0)
            assert largest_estimate(lengths, replicas, got) <= largest_estimate(lengths, replicas, greedy)


def test_evens_out_what_the_greedy_cannot():
    """Two equal replicas, cost = tokens: longest first gives 3+2+2 | 3+2 (7); the search
    finds 3+3 | 2+2+2 (6)."""
    lengths = np.array([3, 3, 2, 2, 2], dtype=np.int64)
    replicas = [S.ReplicaCost(0.0, 1.0, 0.0, 0.0, 1, 10, 10)] * 2
    greedy = S.reference(lengths.tolist(), [tuple(r) for r in replicas], 0, restarts=0, budget=0)
    assert largest_estimate(lengths, replicas, greedy) == 7.0
    got = S.search(lengths, replicas, seed=0)
    assert largest_estimate(lengths, replicas, got) == 6.0
    assert sorted(lengths[np.array(got) == got[0]].tolist()) in ([3, 3], [2, 2, 2])


def test_a_long_document_goes_where_it_fits():
    """A 9000-token document fits only the second replica type; the rest balance around it."""
    small = S.ReplicaCost(0.0, 1.0, 0.0, 0.0, 1, 4096, 4096)
    large = S.ReplicaCost(0.0, 0.5, 0.0, 0.0, 1, 16384, 16384)
    lengths = np.array([9000, 4000, 3000, 2000, 1000, 500], dtype=np.int64)
    got = S.search(lengths, [small, small, large], seed=3)
    assert got[0] == 2

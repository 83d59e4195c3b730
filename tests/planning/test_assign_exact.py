"""The HiGHS references agree with the heuristics on tiny instances (needs highspy)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("highspy")

from dcp_ext.assign import ReplicaCost, balance, plan_replicas, replica_time  # noqa: E402
from dcp_ext.assign.exact import exact_balance, exact_plan, lp_lower_bound  # noqa: E402

REPLICAS = [ReplicaCost(1e-9, 2e-5, 1e-4, 3e-3, 1, 4096, 4096),
            ReplicaCost(1e-9, 2e-5, 1e-4, 3e-3, 1, 4096, 4096),
            ReplicaCost(2.5e-10, 5e-6, 1e-4, 3e-3, 2, 16384, 16384)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_references_bracket_the_heuristic(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 6000, size=7)
    ours = plan_replicas(lengths, REPLICAS)
    full = exact_plan(lengths, REPLICAS, time_limit=20, start=ours.micro_batches)
    stage1 = exact_balance(lengths, REPLICAS, time_limit=20)
    assert full.optimal and stage1.optimal
    # the full optimum is a valid plan, priced by replica_time
    seen = sorted(i for rmbs in full.micro_batches for mb in rmbs for i in mb)
    assert seen == list(range(len(lengths)))
    for rc, rmbs, t in zip(REPLICAS, full.micro_batches, full.replica_times):
        assert all(sum(lengths[i] for i in mb) <= rc.max_mb_tokens for mb in rmbs)
        assert t == pytest.approx(replica_time(lengths, rmbs, rc))
    # chain of bounds: LP <= stage-1 optimum <= full optimum <= our plan; stage-1 heuristic >= its optimum
    assert lp_lower_bound(lengths, REPLICAS) <= stage1.makespan * (1 + 1e-9)
    assert stage1.makespan <= full.makespan * (1 + 1e-6)
    assert full.makespan <= ours.makespan * (1 + 1e-6)
    assert balance(lengths, REPLICAS).makespan >= stage1.makespan * (1 - 1e-6)


def test_lp_bound_identical_replicas_is_total_over_r():
    rc = ReplicaCost(0.0, 1.0, 0.0, 0.0, 1, 100, 100)
    assert lp_lower_bound([10, 20, 30, 40], [rc, rc]) == pytest.approx(50.0)
    assert lp_lower_bound([90, 5, 5], [rc, rc]) == pytest.approx(90.0)  # largest single cost

"""Bad input raises ValueError naming the offending item; backend selection and fallback."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from dcp_ext.assign import ReplicaCost, backend, balance, baseline_plan, pack, pack_assignment, plan_replicas

RC = ReplicaCost(1e-9, 1e-5, 1e-4, 1e-3, 2, 8192, 8192)
ENTRY_POINTS = [
    lambda L, R: balance(L, R, impl="python"),
    lambda L, R: plan_replicas(L, R, impl="python"),
    lambda L, R: baseline_plan("isf", L, R, impl="python"),
]


@pytest.mark.parametrize("call", ENTRY_POINTS)
@pytest.mark.parametrize("lengths,match", [
    ([100, 0, 5], r"sequence 1 has non-positive length 0"),
    ([100, 5, -3], r"sequence 2 has non-positive length -3"),
    ([1.5, 2], r"sequence 0 has length 1.5"),
    ([1, float("nan")], r"sequence 1 has length nan"),
    ([[1, 2]], r"one-dimensional"),
    ([1, "x"], r"sequence 1 has length 'x'"),
    ([100] * 17 + [9000], r"sequence 17 \(length 9000\) exceeds every replica's max_seq_len / max_mb_tokens \(max 8192\)"),
])
def test_bad_lengths(call, lengths, match):
    with pytest.raises(ValueError, match=match):
        call(lengths, [RC, RC])


@pytest.mark.parametrize("field,value,match", [
    ("a", float("nan"), r"replica 1: a = nan is not finite"),
    ("b", -1e-5, r"replica 1: b = -1e-05 must be >= 0"),
    ("c", float("inf"), r"replica 1: c = inf is not finite"),
    ("mb_overhead", float("nan"), r"replica 1: mb_overhead = nan is not finite"),
    ("pp", 0, r"replica 1: pp = 0 must be >= 1"),
    ("pp", 1.5, r"replica 1: pp = 1.5 is not an integer"),
    ("max_seq_len", 0, r"replica 1: max_seq_len = 0 must be >= 1"),
    ("max_mb_tokens", -4, r"replica 1: max_mb_tokens = -4 must be >= 1"),
    ("a", "fast", r"replica 1: a = 'fast' is not a number"),
])
@pytest.mark.parametrize("call", ENTRY_POINTS)
def test_bad_replica(call, field, value, match):
    bad = ReplicaCost(**{**RC.__dict__, field: value})
    with pytest.raises(ValueError, match=match):
        call([10, 20], [RC, bad])


@pytest.mark.parametrize("call", ENTRY_POINTS)
def test_no_replicas(call):
    with pytest.raises(ValueError, match="no replicas given"):
        call([10, 20], [])


def test_not_a_replica_cost():
    with pytest.raises(ValueError, match=r"replica 0 is a tuple, expected ReplicaCost"):
        balance([10], [(1e-9, 1e-5, 0.0, 0.0, 1, 100, 100)])


def test_pack_errors():
    with pytest.raises(ValueError, match=r"sequence 1 \(length 9000\) exceeds the replica's capacity"):
        pack([10, 9000], RC)
    small_mb = ReplicaCost(0.0, 1e-5, 0.0, 0.0, 1, 8192, 1024)  # a sequence must also fit one micro-batch
    with pytest.raises(ValueError, match=r"sequence 0 \(length 2000\) exceeds"):
        pack([2000], small_mb)
    with pytest.raises(ValueError, match=r"replica 0: pp = 0"):
        pack([10], ReplicaCost(0.0, 1e-5, 0.0, 0.0, 0, 100, 100))


def test_option_errors():
    with pytest.raises(ValueError, match=r"restarts must be an integer >= 0, got -1"):
        balance([10], [RC], restarts=-1)
    with pytest.raises(ValueError, match=r"ls_budget must be an integer >= 0"):
        plan_replicas([10], [RC], ls_budget=1.5)
    with pytest.raises(ValueError, match=r"seed must be an integer"):
        balance([10], [RC], seed="x")
    with pytest.raises(ValueError, match=r"unknown baseline 'fifo'"):
        baseline_plan("fifo", [10], [RC])
    with pytest.raises(ValueError, match=r"impl must be"):
        balance([10], [RC], impl="fortran")


def test_pack_assignment_errors():
    with pytest.raises(ValueError, match=r"sequence 1 is assigned to replica 2, not in \[0, 2\)"):
        pack_assignment([10, 20], [RC, RC], [0, 2])
    short = ReplicaCost(0.0, 1e-5, 0.0, 0.0, 1, 100, 100)
    with pytest.raises(ValueError, match=r"sequence 0 \(length 500\) does not fit replica 1"):
        pack_assignment([500], [RC, short], [1])


def test_pack_assignment_matches_plan():
    lengths = [300, 5, 4000, 1200, 77, 2048, 2048, 9]
    res = plan_replicas(lengths, [RC, RC], impl="python")
    again = pack_assignment(lengths, [RC, RC], res.assignment, impl="python")
    assert again.micro_batches == res.micro_batches
    assert again.replica_times.tolist() == res.replica_times.tolist()


def test_env_var_selects_python(monkeypatch):
    monkeypatch.setenv("DCP_ASSIGN_IMPL", "python")
    assert backend.default_backend().name == "python"
    monkeypatch.setenv("DCP_ASSIGN_IMPL", "rust")
    with pytest.raises(ValueError, match="DCP_ASSIGN_IMPL"):
        backend.default_backend()


def test_missing_extension_warns_once(monkeypatch):
    monkeypatch.delenv("DCP_ASSIGN_IMPL", raising=False)
    monkeypatch.setattr(backend, "_CPP", None)
    monkeypatch.setattr(backend, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend.default_backend().name == "python"
        assert backend.default_backend().name == "python"
        balance([10, 20], [RC])
    assert [str(w.message) for w in caught].count(str(caught[0].message)) == 1
    assert "not built" in str(caught[0].message)
    monkeypatch.setenv("DCP_ASSIGN_IMPL", "cpp")
    with pytest.raises(ImportError, match="not built"):
        backend.default_backend()


def test_large_values_do_not_overflow():
    res = plan_replicas(np.array([2**40, 3], dtype=np.int64),
                        [ReplicaCost(0.0, 1e-12, 0.0, 0.0, 1, 2**41, 2**41)], impl="python")
    assert math.isfinite(res.makespan)

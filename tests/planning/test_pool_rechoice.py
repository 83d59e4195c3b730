"""The candidate pool chosen again from measured prices (`--dcp-recalibration on`): only
among replica types registered at start (their process groups exist; none is created
later), the static entry kept, the choice checkpointed, and nothing changed when off."""
import copy
import functools
import json
import random

import numpy as np
import pytest

from dcp_ext.planning.calibration import Calibration, MicroBatchSample, Observation, SyncSample
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.layout import describe
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec.from_preset("demo")
# 256 MB per rank: a 2048-token document needs cp or tp there (the CPU attention is quadratic)
CLUSTER = ClusterSpec.cpu_gloo(4).with_(memory_bytes=256e6, reserved_bytes=0.0)
LENS = [int(x) for x in np.random.default_rng(0).choice([64, 200, 512, 1024, 2048], size=400, p=[.4, .3, .15, .1, .05])]


@functools.lru_cache(maxsize=None)
def _built(rechoose, static_layout):
    return make_planner("adaptive", MODEL, CLUSTER, max_seq_len=2048, global_batch_tokens=8192, length_sample=LENS,
                        seed=0, rechoose_pool=rechoose, static_layout=static_layout)


def planner(rechoose=True, static_layout=None):
    """A fresh planner (built once per setting, ~1.5 s, then copied) with an empty calibration."""
    p = copy.deepcopy(_built(rechoose, static_layout))
    p.calibrate_online(Calibration())
    return p


def measure(p, start, count, slow_unsplit=6.0):
    """`count` iterations measured on a machine where replicas of one rank (tp1 cp1) run
    `slow_unsplit` times slower than the prior and every other layout as priced."""
    rng = random.Random(start)
    cm = p.cm
    for i in range(start, start + count):
        mbs, syncs = [], []
        for lay in cm.all_layouts():
            docs = [rng.choice([64, 200, 512]) for _ in range(rng.randint(1, 4))]
            s = np.asarray(docs, dtype=float)
            k = slow_unsplit if lay.size == 1 else 1.0
            mbs.append(MicroBatchSample(tuple(lay), 0, float(s @ s), float(s.sum()), len(docs),
                                        k * cm.prior_coeffs(lay, 0).mb_time(float(s @ s), float(s.sum()), len(docs))))
            syncs.append(SyncSample(tuple(lay), 4 // lay.size, cm.prior_sync_time(lay, 4 // lay.size)))
        p.cm.calibration.add(Observation(i, mbs, syncs, 0.0))
        p.recalibrate()


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    out, k = [], 0
    for _ in range(n):
        b = rng.choice(LENS, 60)
        b = [int(x) for x in b[np.cumsum(b) <= 8192]]
        out.append((list(range(k, k + len(b))), b))
        k += len(b)
    return out


def used_types(it):
    return {(r.tp, r.cp, r.pp, tuple(r.ranks)) for r in it.replicas}


def registered(p):
    return {(t.tp, t.cp, t.pp, tuple(t.ranks)) for t in p.replica_types()}


def test_the_pool_chosen_again_from_measured_prices_plans_only_types_registered_at_start():
    p = planner()
    start_pool = [describe(c) for c in p.pool.layouts]
    at_start = registered(p)
    assert {Layout(1, 1, 1), Layout(1, 2, 1)} <= set(p.reserve) and len(p.reserve) > len({l for c in p.pool.layouts for l, _ in c})
    measure(p, 0, 1)
    assert not p._pool_stale  # one recalibration: prices still settling
    measure(p, 1, 1)
    assert p._pool_stale  # the 2nd: chosen again before the next plan
    plans = [p.plan(i, ids, lens) for i, (ids, lens) in enumerate(batches(8))]
    new_pool = [describe(c) for c in p.pool.layouts]
    assert new_pool != start_pool, "the measured prices (one-rank replicas 6x slower) changed nothing"
    assert all(any(l.size > 1 for l, _ in c) for c in p.pool.layouts if c != p.static_entry)
    assert registered(p) == at_start  # nothing registered after the start
    for it in plans:
        assert used_types(it) <= at_start, used_types(it) - at_start
    assert any(any(r.tp * r.cp > 1 for r in it.replicas) and any(r.tp * r.cp == 1 for r in it.replicas) or
               all(r.tp * r.cp > 1 for r in it.replicas) for it in plans)


def test_the_static_entry_stays_first_in_a_pool_chosen_again():
    p = planner(static_layout=(1, 1, 1))
    entry = p.static_entry
    assert p.pool.layouts[0] == entry
    measure(p, 0, 2)
    p.plan(0, *batches(1)[0])
    assert p.pool.layouts[0] == entry and len(p.pool.layouts) <= p.max_layouts


def test_off_keeps_the_start_pool_and_registers_only_its_types():
    on, off = planner(True), planner(False)
    assert [describe(c) for c in on.pool.layouts] == [describe(c) for c in off.pool.layouts]
    assert registered(off) < registered(on) and off.reserve == []
    start = [describe(c) for c in off.pool.layouts]
    measure(off, 0, 8)
    for i, (ids, lens) in enumerate(batches(3)):
        assert on.plan(i, ids, lens).predicted_time_s > 0 and off.plan(i, ids, lens)
    assert [describe(c) for c in off.pool.layouts] == start


def test_a_resumed_planner_takes_back_the_pool_chosen_again_and_plans_the_same():
    live = planner()
    measure(live, 0, 2)
    todo = batches(6)
    for i, (ids, lens) in enumerate(todo[:3]):
        live.plan(i, ids, lens)
    state = json.loads(json.dumps(live.planning_state()))
    resumed = planner()
    resumed.load_planning_state(state)
    assert [describe(c) for c in resumed.pool.layouts] == [describe(c) for c in live.pool.layouts]
    for i, (ids, lens) in enumerate(todo[3:], start=3):
        a, b = live.plan(i, ids, lens), resumed.plan(i, ids, lens)
        assert a.predicted_time_s == b.predicted_time_s and used_types(a) == used_types(b)


def test_a_saved_pool_with_an_unregistered_type_is_not_taken_back():
    live = planner()
    measure(live, 0, 2)
    live.plan(0, *batches(1)[0])
    state = json.loads(json.dumps(live.planning_state()))
    fresh = planner()
    outside = next(l for l in fresh.cm.all_layouts() if l not in fresh.reserve and 4 % l.size == 0)
    state["pool"] = [f"{4 // outside.size}x{outside}"]  # a layout outside the reserve: never registered
    start = [describe(c) for c in fresh.pool.layouts]
    fresh.load_planning_state(state)
    assert [describe(c) for c in fresh.pool.layouts] == start


def test_memory_charged_beyond_the_start_pool_moves_the_longest_documents_to_the_reserve():
    """The runtime's memory beyond the cost model, charged: a rechoosing planner may reserve
    more of it than one held to its start pool (its reserve holds the longest document
    with room), and still plans a batch holding that document."""
    on, off = planner(True), planner(False)
    for p in (on, off):
        cap = p.cm.capacity_bytes
        p.cm.calibration.add(Observation(0, [], [], 0.0, 0.5 * cap))
        p.recalibrate()
    assert on.cm.calibration.memory_reserve > off.cm.calibration.memory_reserve
    assert on._pool_stale
    ids, lens = list(range(5)), [2048, 100, 300, 64, 900]
    it = on.plan(0, ids, lens)
    assert used_types(it) <= registered(on)
    assert on._holds_longest()


def test_communicators_are_counted_once_per_distinct_group_of_two_or_more_ranks():
    from dcp_ext.planning.layout import ReplicaType, communicators_per_rank, distinct_groups

    def aligned(tp, cp, pp):
        size = tp * cp * pp
        return [ReplicaType(tp, cp, pp, tuple(range(s, s + size))) for s in range(0, 4, size)]

    # tp2's groups, pp2's pipeline and embedding groups and cp2's are the same pairs {0,1}, {2,3}
    types = aligned(1, 1, 1) + aligned(2, 1, 1) + aligned(1, 1, 2) + aligned(1, 2, 1)
    assert communicators_per_rank(types, 4) == [1, 1, 1, 1]
    assert communicators_per_rank(types + aligned(4, 1, 1), 4) == [2, 2, 2, 2]
    # tp2·cp2: tp pairs {0,1},{2,3}, cp pairs {0,2},{1,3}, and all four
    assert communicators_per_rank(aligned(2, 2, 1), 4) == [3, 3, 3, 3]
    groups = distinct_groups(types)
    assert len(groups) == len(set(groups)) and (0,) in groups  # one-rank groups exist, hold no communicator


def test_the_cost_model_charges_communicators_beyond_the_gpu_kinds_reserve():
    from dcp_ext.planning.cost_model import CostModel
    from dcp_ext.planning.specs import GiB

    gpu = CostModel(ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset("h200x64"))
    lay = Layout(2, 1, 1)
    base = gpu.state_bytes(lay)
    gpu.communicators = 8  # what a static Megatron job has: in reserved_bytes already
    assert gpu.state_bytes(lay) == base
    gpu.communicators = 11
    assert gpu.state_bytes(lay) == pytest.approx(base + 3 * 0.25 * GiB)
    cpu = CostModel(MODEL, CLUSTER)
    cpu.communicators = 40  # gloo groups hold no device memory
    assert cpu.communicator_bytes == 0.0

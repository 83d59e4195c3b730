"""Online recalibration: the fit recovers a machine's true prices, follows drift, ignores
outliers, is the same on every rank and survives a checkpoint; planners plan with it."""
import json
import random

import numpy as np
import pytest

from dcp_ext.planning.calibration import (Calibration, MicroBatchSample, Observation, SyncSample, observe,
                                          ridge_nnls, robust_fit)
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec.from_preset("demo")
CLUSTER = ClusterSpec.cpu_gloo(4)
TRUE_K = (1.6, 0.7, 2.2, 1.0)  # this "machine": c0, attention, per token, per document vs the analytic prior


def calibrated_model():
    """A cost model with an (empty) online calibration: (cost model, calibration)."""
    cm, cal = CostModel(MODEL, CLUSTER), Calibration()
    cm.calibration = cal
    return cm, cal


def true_stage_seconds(cm, lay, rs, lengths, k=TRUE_K):
    co = cm.prior_coeffs(lay, rs)
    s = np.asarray(lengths, dtype=float)
    s2, t = float(s @ s), float(s.sum())
    return k[0] * co.c0 + k[1] * co.a * s2 + k[2] * (co.b * t + co.excess(s2, t)) + k[3] * co.c * len(s)


def micro_batches(rng, n):
    out = []
    for _ in range(n):
        docs = [int(x) for x in rng.choice([37, 120, 300, 512, 900, 1500, 2048], size=rng.integers(1, 5))]
        out.append(docs)
    return out


def sample(cm, lay, rs, docs, noise, rng, k=TRUE_K):
    secs = true_stage_seconds(cm, lay, rs, docs, k) * (1 + noise * rng.standard_normal())
    s = np.asarray(docs, dtype=float)
    return MicroBatchSample(tuple(lay), rs, float(s @ s), float(s.sum()), len(docs), secs)


def feed(cal, cm, lays, count, rng, noise=0.02, k=TRUE_K, start=0):
    for i, docs in enumerate(micro_batches(rng, count)):
        lay = lays[i % len(lays)]
        cal.add(Observation(start + i, [sample(cm, lay, 0, docs, noise, rng, k)], [], 0.0))
    cal.apply(cm)
    cm.recalibrated()


def rel_err(cm, lay, docs, k=TRUE_K):
    return abs(cm.mb_stage_time(docs, lay) - true_stage_seconds(cm, lay, 0, docs, k)) / true_stage_seconds(cm, lay, 0, docs, k)


def test_ridge_nnls_matches_least_squares_of_the_augmented_system():
    rng = np.random.default_rng(0)
    X = rng.uniform(0.1, 1.0, size=(30, 4))
    y = X @ np.array([0.5, 1.5, 0.8, 1.2]) + 0.01 * rng.standard_normal(30)
    prior, ridge = [1.0, 1.0, 1.0, 1.0], 0.5
    A = np.vstack([X, np.sqrt(ridge) * np.eye(4)])
    b = np.concatenate([y, np.sqrt(ridge) * np.array(prior)])
    ref = np.linalg.lstsq(A, b, rcond=None)[0]
    assert np.all(ref > 0)
    assert np.allclose(ridge_nnls(X.tolist(), y.tolist(), prior, ridge), ref, rtol=1e-9, atol=1e-12)
    # a negative unconstrained optimum is clipped to the best non-negative one
    k = ridge_nnls(X.tolist(), (X @ np.array([1.0, -2.0, 1.0, 1.0])).tolist(), [0.0] * 4, 1e-6)
    assert min(k) >= 0 and k[1] == 0.0


def test_fit_recovers_the_machine_and_prices_held_out_micro_batches():
    rng = np.random.default_rng(1)
    cm, cal = calibrated_model()
    lay = Layout(1, 1, 1)
    held_out = micro_batches(np.random.default_rng(99), 40)
    before = np.median([rel_err(cm, lay, d) for d in held_out])
    feed(cal, cm, [lay], 48, rng)
    after = np.median([rel_err(cm, lay, d) for d in held_out])
    assert before > 0.25 and after < 0.03, (before, after)


def test_outliers_do_not_move_the_fit():
    rng = np.random.default_rng(2)
    lay = Layout(1, 1, 1)
    clean_cm, dirty_cm = CostModel(MODEL, CLUSTER), CostModel(MODEL, CLUSTER)
    clean, dirty = Calibration(), Calibration()
    clean_cm.calibration, dirty_cm.calibration = clean, dirty
    mbs = micro_batches(rng, 40)
    for i, docs in enumerate(mbs):
        s = sample(clean_cm, lay, 0, docs, 0.01, np.random.default_rng(i))
        clean.add(Observation(i, [s], [], 0.0))
        # every eighth micro-batch hit by a stall (4x slower), another one timed short (0.3x)
        factor = 4.0 if i % 8 == 3 else 0.3 if i % 8 == 6 else 1.0
        bad = MicroBatchSample(s.layout, s.rs, s.s2, s.tokens, s.n_docs, s.stage_s * factor)
        dirty.add(Observation(i, [bad], [], 0.0))
    for cal, cm in ((clean, clean_cm), (dirty, dirty_cm)):
        cal.apply(cm)
        cm.recalibrated()
    probe = micro_batches(np.random.default_rng(7), 20)
    assert np.median([rel_err(dirty_cm, lay, d) for d in probe]) < 0.03
    assert np.median([abs(dirty_cm.mb_stage_time(d, lay) / clean_cm.mb_stage_time(d, lay) - 1) for d in probe]) < 0.03
    # without dropping them, the stalls would have moved the prices
    samples = list(dirty.micro_batches[((1, 1, 1), 0)])
    rows = [[p / s.stage_s for p in Calibration._parts(dirty_cm, s)] for s in samples]
    naive = ridge_nnls(rows, [1.0] * len(rows), [1.0] * 4, 0.05)
    naive_cm = CostModel(MODEL, CLUSTER)
    naive_cm.calibration = dirty
    dirty._k[((1, 1, 1), 0)] = naive
    naive_cm.recalibrated()
    assert np.median([rel_err(naive_cm, lay, d) for d in probe]) > 0.1


def test_the_window_follows_a_machine_that_slows_down():
    rng = np.random.default_rng(3)
    cm, cal = calibrated_model()
    lay = Layout(1, 1, 1)
    feed(cal, cm, [lay], 48, rng)
    slower = tuple(2 * x for x in TRUE_K)  # a shared cluster's speed drifts: everything twice as slow
    feed(cal, cm, [lay], 48, rng, k=slower, start=48)
    probe = micro_batches(np.random.default_rng(5), 20)
    assert np.median([rel_err(cm, lay, d, slower) for d in probe]) < 0.03


def test_an_unseen_layout_takes_the_pooled_correction():
    rng = np.random.default_rng(4)
    cm, cal = calibrated_model()
    seen, unseen = Layout(1, 1, 1), Layout(1, 2, 1)
    feed(cal, cm, [seen], 48, rng)
    assert cal.corrections(unseen, 0) == cal.corrections(seen, 0) or \
        np.allclose(cal.corrections(unseen, 0), cal._k_pooled)
    probe = micro_batches(np.random.default_rng(6), 20)
    prior_err = np.median([abs(cm.prior_coeffs(unseen).mb_time(float(np.dot(d, d)), sum(d), len(d))
                               - true_stage_seconds(cm, unseen, 0, d)) / true_stage_seconds(cm, unseen, 0, d)
                           for d in probe])
    assert np.median([rel_err(cm, unseen, d) for d in probe]) < prior_err / 3


def test_sync_and_time_outside_replicas():
    cm, cal = calibrated_model()
    lay = Layout(1, 1, 1)
    prior = cm.prior_sync_time(lay, 4)
    for i in range(9):
        cal.add(Observation(i, [], [SyncSample(tuple(lay), 4, prior * (3.0 if i != 4 else 50.0))], 0.040 + 0.001 * i))
    cal.apply(cm)
    assert cm.sync_time(lay, 4) == pytest.approx(3 * prior)  # the median: one stalled sync does not count
    assert cm.iteration_overhead_s == pytest.approx(0.044)


def test_state_round_trips_through_json_to_the_same_bits():
    rng = np.random.default_rng(8)
    cm, cal = calibrated_model()
    feed(cal, cm, [Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1)], 60, rng)
    cal.add(Observation(60, [sample(cm, Layout(1, 1, 1), 0, [300, 512], 0.0, rng)], [], 0.01))  # queued
    state = json.loads(json.dumps(cal.state_dict()))
    cm2, cal2 = calibrated_model()
    cal2.load_state_dict(state, cm2)
    for lay in (Layout(1, 1, 1), Layout(2, 1, 1), Layout(1, 2, 1), Layout(4, 1, 1)):
        assert cm2.coeffs(lay, 0) == cm.coeffs(lay, 0)
    assert len(cal2.pending) == 1 and cal2.applied_through == cal.applied_through
    cal.apply(cm)
    cal2.apply(cm2)
    cm.recalibrated()
    cm2.recalibrated()
    assert cm2.coeffs(Layout(1, 1, 1), 0) == cm.coeffs(Layout(1, 1, 1), 0)


def test_the_fit_does_not_depend_on_numpy_threads_or_order_of_layout_keys():
    """Plain floats in a fixed order: two calibrations fed the same observations in the same
    order agree to the last bit (every rank refits on its own)."""
    rng = np.random.default_rng(9)
    obs = []
    cm = CostModel(MODEL, CLUSTER)
    for i, docs in enumerate(micro_batches(rng, 30)):
        lay = [Layout(1, 1, 1), Layout(2, 2, 1)][i % 2]
        obs.append(Observation(i, [sample(cm, lay, 0, docs, 0.05, rng)], [], 0.02))
    fits = []
    for _ in range(2):
        c, cal = calibrated_model()
        for o in obs:
            cal.add(o)
        cal.apply(c)
        fits.append(json.dumps([cal.corrections(l, 0) for l in (Layout(1, 1, 1), Layout(2, 2, 1), Layout(4, 1, 1))]))
    assert fits[0] == fits[1]


def test_observe_maps_plan_and_timings_to_samples():
    planner = make_planner("adaptive", MODEL, CLUSTER, max_seq_len=2048, global_batch_tokens=8192,
                           length_sample=[100, 300, 700, 1500, 2048] * 20, seed=0)
    lengths = [2048, 700, 300, 300, 100, 100, 1500, 700]
    it = planner.plan(0, list(range(len(lengths))), lengths)
    mb = [[0.1 * (j + 1) for j in range(len(r.micro_batches))] for r in it.replicas]
    o = observe(it, dict(enumerate(lengths)), mb, [0.01] * len(it.replicas), [1.0] * len(it.replicas), 1.3,
                planner.cm.stage_recompute)
    assert len(o.micro_batches) == sum(len(r.micro_batches) for r in it.replicas)
    assert sum(s.tokens for s in o.micro_batches) == sum(lengths)
    assert o.outside_s == pytest.approx(0.3)
    first = it.replicas[0]
    assert o.micro_batches[0].stage_s == pytest.approx(0.1 / first.pp)
    assert o.micro_batches[0].layout == (first.tp, first.cp, first.pp)


def test_a_planner_plans_with_the_measured_prices():
    """A machine twice as slow as the prior in every term: after recalibration the plans'
    predicted times are about twice the uncalibrated ones (plus the measured time outside)."""
    lens = [int(x) for x in np.random.default_rng(0).choice([64, 200, 512, 1024, 2048], size=400)]
    kw = dict(max_seq_len=2048, global_batch_tokens=8192, length_sample=lens, seed=0)
    fixed = make_planner("adaptive", MODEL, CLUSTER, **kw)
    live = make_planner("adaptive", MODEL, CLUSTER, **kw)
    cal = Calibration()
    live.calibrate_online(cal)
    assert live.recalibrate() is False  # nothing measured yet: the same prices
    batch = lens[:12]
    base = fixed.plan(0, list(range(12)), batch)
    assert live.plan(0, list(range(12)), batch).predicted_time_s == base.predicted_time_s
    rng = random.Random(0)
    cm = live.cm
    for i in range(40):
        mbs, syncs = [], []
        for lay in cm.all_layouts():
            docs = [rng.choice([64, 200, 512, 1024]) for _ in range(rng.randint(1, 4))]
            s = np.asarray(docs, dtype=float)
            secs = 2 * cm.prior_coeffs(lay, 0).mb_time(float(s @ s), float(s.sum()), len(docs))
            mbs.append(MicroBatchSample(tuple(lay), 0, float(s @ s), float(s.sum()), len(docs), secs))
            syncs.append(SyncSample(tuple(lay), 4 // lay.size, 2 * cm.prior_sync_time(lay, 4 // lay.size)))
        cal.add(Observation(i, mbs, syncs, 0.05))
    assert live.recalibrate() is True
    again = live.plan(1, list(range(12)), batch)
    fixed_again = fixed.plan(1, list(range(12)), batch)
    assert again.predicted_time_s == pytest.approx(2 * fixed_again.predicted_time_s + 0.05, rel=0.05)
    state = live.planning_state()
    assert state["calibration"]["applied_through"] == 39


def _planners(name, **extra):
    lens = [int(x) for x in np.random.default_rng(0).choice([64, 200, 512, 1024, 2048], size=400)]
    kw = dict(max_seq_len=2048, global_batch_tokens=8192, length_sample=lens, seed=0, **extra)
    live = make_planner(name, MODEL, CLUSTER, **kw)
    live.calibrate_online(Calibration())
    return live, lens


@pytest.mark.parametrize("name", ["adaptive", "static"])
def test_memory_measured_beyond_the_model_is_charged_against_the_capacity(name):
    """The runtime holds memory the cost model does not price (the demo on 4 CPU ranks: 14-27
    MiB above the predicted peaks). Measured, it is reserved from the next plan on: every
    plan after fits the smaller capacity, the most measured counts, and it is checkpointed."""
    from dcp_ext.planning.simulator import simulate_iteration

    live, lens = _planners(name, **({"layout": (2, 1, 1)} if name == "static" else {}))
    cal, cm = live.cm.calibration, live.cm
    before = cm.capacity_bytes
    for i, excess in enumerate([6 * 2**20, 20 * 2**20, 3 * 2**20]):
        cal.add(Observation(i, [], [], 0.0, float(excess)))
    assert live.recalibrate() is True
    assert cal.memory_reserve == cal.memory_excess == 20 * 2**20  # the most measured, all of it
    assert cm.capacity_bytes == pytest.approx(before - 20 * 2**20)
    for k in range(6):
        ids = list(range(12 * k, 12 * k + 12))
        it = live.plan(k, ids, [lens[i] for i in ids])
        result = simulate_iteration(cm, it, {i: lens[i] for i in ids})
        assert result.peak_bytes <= cm.capacity_bytes * (1 + 1e-9)
    state = json.loads(json.dumps(live.planning_state()))
    again, _ = _planners(name, **({"layout": (2, 1, 1)} if name == "static" else {}))
    again.load_planning_state(state)
    assert again.cm.capacity_bytes == cm.capacity_bytes


def test_only_the_part_of_a_reserve_that_leaves_the_longest_document_a_place_is_charged():
    live, lens = _planners("adaptive")
    cal, cm = live.cm.calibration, live.cm
    before = cm.capacity_bytes
    cal.add(Observation(0, [], [], 0.0, before - 2**20))  # would leave 1 MiB for all of the state and activations
    live.recalibrate()
    assert 0 < cal.memory_reserve < before - 2**20 and cal.memory_excess == before - 2**20
    assert cm.capacity_bytes == pytest.approx(before - cal.memory_reserve)
    assert live._holds_longest()
    cal.memory_reserve *= 1.01  # a little more and the longest document has nowhere to go
    live._prices_changed()
    assert not live._holds_longest()
    cal.memory_reserve /= 1.01
    live._prices_changed()
    ids = list(range(5))
    live.plan(0, ids, [2048, 100, 300, 64, 900])  # the longest document still has a place

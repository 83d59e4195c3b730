"""Profile files: fitting recovers known coefficients, round trip, calibrated pricing."""
import numpy as np
import pytest

from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.profile import Profile, ProfileRecord, evaluate_profile, fit_profile, split_holdout
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

TRUE = {  # per strategy: (a, b, c, c0) of the whole replica, made up
    (1, 1, 1, 0): (2e-7, 1e-3, 2e-3, 0.05),
    (2, 1, 1, 0): (1.1e-7, 6e-4, 2e-3, 0.07),
    (1, 2, 1, 0): (1.0e-7, 5.5e-4, 4e-3, 0.08),
    (1, 1, 2, 4): (2.2e-7, 1.4e-3, 3e-3, 0.09),
}


def _records(noise=0.0, seed=0, layers=None):
    rng = np.random.default_rng(seed)
    out = []
    for key, (a, b, c, c0) in TRUE.items():
        for total in [64, 128, 256, 512, 768, 1024, 1536, 2048]:
            for ndocs in [1, 2, 4]:
                lens = [total // ndocs] * ndocs
                s = np.asarray(lens, float)
                t = c0 + a * (s @ s) + b * s.sum() + c * len(s)
                t *= 1 + noise * rng.standard_normal()
                out.append(ProfileRecord(*key, lengths=lens, seconds=float(t), num_layers=layers))
    return out


def test_fit_recovers_coefficients():
    prof = fit_profile(_records())
    for key, (a, b, c, c0) in TRUE.items():
        f = prof.fits[key]
        assert (f.a, f.b, f.c, f.c0) == pytest.approx((a, b, c, c0), rel=1e-6)
    assert evaluate_profile(prof, _records()) < 1e-6


def test_held_out_error_with_noise():
    recs = _records(noise=0.03, seed=1)
    fit, held = split_holdout(recs)
    assert held and fit
    held_totals = {sum(r.lengths) for r in held}
    assert not held_totals & {sum(r.lengths) for r in fit if r.key == held[0].key}
    err = evaluate_profile(fit_profile(fit), held)
    assert err < 6.0  # 3% noise


def test_save_load_round_trip(tmp_path):
    prof = fit_profile(_records(), model={"name": "demo"}, cluster={"name": "cpu-gloox4"}, sync={(1, 1, 1): 0.01})
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = Profile.load(str(path))
    assert back.fits.keys() == prof.fits.keys()
    assert back.sync == {(1, 1, 1): 0.01}
    r = _records()[5]
    assert back.predict(r) == pytest.approx(prof.predict(r))


def test_cost_model_uses_the_fit_per_stage():
    model, cluster = ModelSpec.from_preset("demo"), ClusterSpec.cpu_gloo(4)
    prof = fit_profile(_records(layers=model.num_layers))
    cm = CostModel(model, cluster, prof)
    for (tp, cp, pp, r), (a, b, c, c0) in TRUE.items():
        lay = Layout(tp, cp, pp)
        rs = cm.stage_recompute(lay, r)
        lens = [700, 300]
        want = c0 + a * (700**2 + 300**2) + b * 1000 + c * 2
        assert cm.mb_replica_time(lens, lay, rs) == pytest.approx(want, rel=1e-6)
        f, bw = cm.mb_fwd_bwd(lens, lay, rs)
        assert f + bw == pytest.approx(want / pp, rel=1e-6) and 0 < f < bw
    # a strategy without records: analytic scaled by the fitted/analytic ratios
    cm0 = CostModel(model, cluster)
    lay = Layout(4, 1, 1)
    assert cm.mb_stage_time([500], lay) != pytest.approx(cm0.mb_stage_time([500], lay))
    assert cm.sync_time(Layout(1, 1, 1), 4) == 0.01 or cm.sync_time(Layout(1, 1, 1), 4) > 0


def test_layer_extrapolation():
    # profiled with 2 and 4 layers; t = fixed + layers * per_layer, predicted for 8 layers
    fixed = (0.0, 1e-4, 0.0, 0.02)
    per = (5e-8, 2e-4, 1e-3, 0.01)
    recs = []
    for L in (2, 4):
        for total in (128, 512, 1024, 2048):
            for nd in (1, 2):
                s = np.array([total // nd] * nd, float)
                t = sum((fx + L * pl) * v for fx, pl, v in zip(fixed, per, (s @ s, s.sum(), len(s), 1.0)))
                recs.append(ProfileRecord(1, 1, 1, 0, s.astype(int).tolist(), float(t), num_layers=L))
    f = fit_profile(recs).fits[(1, 1, 1, 0)]
    s = [1000, 200]
    want = sum((fx + 8 * pl) * v for fx, pl, v in zip(fixed, per, (1000**2 + 200**2, 1200, 2, 1.0)))
    assert f.predict(s, num_layers=8) == pytest.approx(want, rel=1e-5)


def test_bad_records_rejected():
    with pytest.raises(ValueError):
        fit_profile([ProfileRecord(1, 1, 1, 0, [], 1.0)])


def test_profile_grid_covers_layouts_and_holds_out_lengths():
    from dcp_ext.planning.profile import profile_grid

    model, cluster = ModelSpec.from_preset("demo"), ClusterSpec.cpu_gloo(4)
    cm = CostModel(model, cluster)
    grid = profile_grid(cm, 2048, layouts=[(1, 1, 1), (2, 1, 1), (1, 2, 1)], points=6)
    assert {(g["tp"], g["cp"], g["pp"]) for g in grid} == {(1, 1, 1), (2, 1, 1), (1, 2, 1)}
    assert {g["recompute_layers"] for g in grid} == {0, model.num_layers}
    # time it with the analytic model as a stand-in for the machine, then hold out
    recs = [ProfileRecord(**g, seconds=cm.mb_replica_time(g["lengths"], Layout(g["tp"], g["cp"], g["pp"]),
                                                          cm.stage_recompute(Layout(g["tp"], g["cp"], g["pp"]), g["recompute_layers"])))
            for g in grid]
    fit, held = split_holdout(recs)
    assert held and evaluate_profile(fit_profile(fit), held) < 2.0  # analytic = quadratic + CP excess

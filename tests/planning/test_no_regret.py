"""Issue 36: the adaptive planner measures before it commits and does not lose to one layout.

- `Calibration.mix_factor`: the measured/predicted wall time of the last mixed training steps
  over that of single-layout ones; the planner weighs mixed plans by it, so a mix that measured
  worse than its price gives way to one layout, with one line.
- `AdaptivePlanner.probe_plan`: the iteration the startup calibration runs for one layout (the
  batch less what the layout cannot hold, on world // size replicas of it), leaving the
  planner's state as it was.
"""
import copy
import functools

import numpy as np
import pytest

from dcp_ext.planning.calibration import RATIO_MIN, Calibration, Observation
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec.from_preset("demo")
CLUSTER = ClusterSpec.cpu_gloo(4).with_(memory_bytes=256e6, reserved_bytes=0.0)
LENS = [int(x) for x in np.random.default_rng(0).choice([64, 200, 512, 1024, 2048], size=400, p=[.4, .3, .15, .1, .05])]


def steps(mixed: float, single: float, n: int = RATIO_MIN) -> list[Observation]:
    """n training steps of each kind, measured at `mixed` and `single` times their predictions."""
    return ([Observation(i, [], [], 0.0, 0.0, True, mixed) for i in range(n)]
            + [Observation(n + i, [], [], 0.0, 0.0, False, single) for i in range(n)])


def calibrated(observations) -> Calibration:
    cal = Calibration()
    for o in observations:
        cal.add(o)
    cal.apply(_built().cm)
    return cal


def test_mix_factor_is_mixed_over_single_and_neutral_until_both_are_measured():
    assert calibrated(steps(1.5, 1.2)).mix_factor == pytest.approx(1.25)
    assert calibrated(steps(0.9, 1.0)).mix_factor == pytest.approx(0.9)
    assert calibrated(steps(1.5, 1.0, RATIO_MIN - 1)).mix_factor == 1.0  # too few of each
    # probes (mixed None) never count, however slow against their prediction
    probes = [Observation(i, [], [], 0.0, 0.0, None, 0.0, True) for i in range(8)]
    assert calibrated(probes + steps(1.0, 1.0)).mix_factor == 1.0
    assert calibrated([Observation(0, [], [], 5.0, 0.0, None, 0.0, True)]).outside_s == 0.0  # nor their time outside
    assert calibrated(steps(9.0, 1.0)).mix_factor == 2.0  # bounded


def test_mix_factor_survives_a_checkpoint():
    cal = calibrated(steps(1.4, 1.0))
    again = Calibration()
    again.load_state_dict(copy.deepcopy(cal.state_dict()), _built().cm)
    assert again.mix_factor == cal.mix_factor == pytest.approx(1.4)


@functools.lru_cache(maxsize=None)
def _built():
    return make_planner("adaptive", MODEL, CLUSTER, max_seq_len=2048, global_batch_tokens=8192, length_sample=LENS,
                        seed=0, rechoose_pool=True, layouts=["1xtp1cp2pp1+2xtp1cp1pp1", "2xtp1cp2pp1"])


def planner(cal: Calibration | None = None):
    p = copy.deepcopy(_built())
    p.calibrate_online(cal if cal is not None else Calibration())
    return p


def a_batch_a_mix_wins():
    """A batch the planner, weighing nothing, runs on the mix (one 1,400-token document that
    tp1 cannot hold, the rest short)."""
    lengths = [1400] + [200] * 30
    return list(range(len(lengths))), lengths


def test_a_mix_that_measured_slower_gives_way_to_one_layout_with_one_line():
    ids, lengths = a_batch_a_mix_wins()
    p = planner(calibrated(steps(1.0, 1.0)))  # measured as priced: the mix stays
    it = p.plan(0, ids, lengths)
    assert len({(r.tp, r.cp, r.pp) for r in it.replicas}) == 2 and not p.notes
    p = planner(calibrated(steps(1.6, 1.0)))  # mixes measured 1.6x their price, one layout as priced
    it = p.plan(0, ids, lengths)
    assert {(r.tp, r.cp, r.pp) for r in it.replicas} == {(1, 2, 1)}
    assert "no regret" in p.notes[0] and "2×cp2 runs instead of cp2 + 2×tp1" in p.notes[0]
    p.plan(1, ids, lengths)
    assert 1 not in p.notes  # said when it turns, not every iteration


def test_probe_plan_runs_one_layout_on_what_it_holds_and_leaves_the_planner_as_it_was():
    p = planner()
    lengths = [2000, 1500, 900, 300, 200, 100]
    ids = [10, 11, 12, 13, 14, 15]
    p.plan(0, ids[2:], lengths[2:])  # a current layout to keep
    before = (p._current, [tuple(c) for c in p.pool.layouts], dict(p.pool_tables))
    for lay in p.probe_layouts():
        it = p.probe_plan(-1, lay, ids, lengths)
        held = [i for i, n in zip(ids, lengths) if n <= p.tables[lay].max_doc]
        assert it is not None and sorted(it.sample_ids) == held
        half = p.probe_plan(-1, lay, ids, lengths, every=2)
        assert sorted(half.sample_ids) == sorted(sorted(held, key=lambda i: -lengths[ids.index(i)])[::2])
        assert {(r.tp, r.cp, r.pp) for r in it.replicas} == {tuple(lay)} and len(it.replicas) == 4 // lay.size
        assert sorted(s for r in it.replicas for mb in r.micro_batches for s in mb.sample_ids) == held
    assert (p._current, [tuple(c) for c in p.pool.layouts], dict(p.pool_tables)) == before
    assert p.probe_plan(-1, Layout(1, 1, 1), [1], [2048]) is None  # nothing it holds

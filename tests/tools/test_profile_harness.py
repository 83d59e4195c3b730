"""dcp-profile's harness on a tiny grid: well-formed records, a profile the cost model loads,
positive predictions that grow with length. No wall-time asserts (times are whatever this
machine did); the grid is 2 layouts x 3 lengths x 1 repeat on 2 gloo ranks."""
import math
import os

import pytest

from dcp_ext.cli.profile import parse_layouts
from megatron.training.adaptive.profiling import main, setup
from dcp_ext.planning.cost_model import CostModel, Layout
from dcp_ext.planning.profile import Profile
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml")]


def test_parse_layouts():
    assert parse_layouts("tp1cp1pp1, tp2,cp2pp2") == [(1, 1, 1), (2, 1, 1), (1, 2, 2)]
    with pytest.raises(SystemExit):
        parse_layouts("tp2xcp2")


def test_rejects_a_layout_the_model_cannot_take():
    with pytest.raises(SystemExit, match="tp3cp1pp1"):
        setup(DEMO + ["--nproc", "4", "--layouts", "tp3cp1pp1"])  # 8 heads are not divisible by 3


@pytest.mark.dist
def test_profile_tiny_grid(tmp_path):
    out = tmp_path / "profile.json"
    # the demo model with 2 of its 4 layers timed: the DCP-style extrapolation path too
    rc = main(DEMO + ["--nproc", "2", "--layouts", "tp1cp1pp1,tp2cp1pp1", "--points", "3", "--docs-per-pack", "1",
                      "--recompute", "none", "--repeats", "1", "--warmup", "0", "--min-seq-len", "32",
                      "--max-seq-len", "384", "--profile-layers", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    prof = Profile.load(str(out))

    assert len(prof.records) == 6
    assert {r.key for r in prof.records} == {(1, 1, 1, 0), (2, 1, 1, 0)}
    for key in {r.key for r in prof.records}:
        assert sorted(sum(r.lengths) for r in prof.records if r.key == key) == [32, 111, 384]
    for r in prof.records:
        assert len(r.lengths) == 1 and r.num_layers == 2
        assert math.isfinite(r.seconds) and 0 < r.seconds < 60

    spec, cluster = ModelSpec.from_json(prof.model), ClusterSpec.from_json(prof.cluster)
    assert spec.num_layers == 4 and spec.hidden_size == 128 and cluster.num_gpus == 2
    assert set(prof.fits) == {(1, 1, 1, 0), (2, 1, 1, 0)}

    cm = CostModel(spec, cluster, prof)
    for tp in (1, 2):
        lay = Layout(tp, 1, 1)
        times = [cm.mb_replica_time([n], lay) for n in (16, 64, 256, 1024)]
        assert all(t > 0 for t in times), times
        assert all(b > a for a, b in zip(times, times[1:])), times
        # 4 planned layers from 2 profiled ones: the fit is scaled, not reused as is
        fit = prof.fits[(tp, 1, 1, 0)]
        assert cm.mb_replica_time([256], lay) == pytest.approx(2 * fit.predict([256]), rel=1e-9)

"""Uneven pipeline stages (OmniBal) in the adaptive planner: the split balances stage times
where the embedding and the output layer weigh (a large vocabulary) and stays even where
they do not; it is fixed per layout (part of the replica types), honoured by the simulator
stage by stage, and every plan is valid and within memory. Pure and fast: fixed pools."""
import numpy as np
import pytest

from dcp_ext.planning.bound_v2 import lower_bound_v2
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layer_cost import LayerPrices
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import Plan, validate_iteration
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.planners.tables import make_type_table
from dcp_ext.planning.planners.stage_split import balanced_split, reference_micro_batch, stage_times
from dcp_ext.planning.simulator import one_f_one_b, one_f_one_b_stages, simulate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

H8 = ClusterSpec.from_preset("h200x8")
BIG_VOCAB = ModelSpec.from_preset("llama2-7b").with_(name="big-vocab", vocab_size=256000)
TINY_VOCAB = ModelSpec.from_preset("llama2-7b").with_(name="tiny-vocab", vocab_size=512)
SAMPLE = [2000, 4000, 8000, 16000, 1000] * 20


def split_of(model, lay):
    cm = CostModel(model, H8)
    return cm, balanced_split(cm, lay, make_type_table(cm, lay), SAMPLE)


def test_a_large_vocabulary_gets_a_shorter_last_stage():
    lay = Layout(1, 1, 4)
    cm, split = split_of(BIG_VOCAB, lay)
    assert sum(split) == 32 and len(split) == 4 and min(split) >= 1
    assert split[-1] < 8 and split != (8, 8, 8, 8)
    ref = reference_micro_batch(make_type_table(cm, lay).cap_mb, SAMPLE)
    lp = LayerPrices(cm)
    assert max(stage_times(lp, lay, split, ref)) < max(stage_times(lp, lay, [8] * 4, ref))


@pytest.mark.parametrize("lay", [Layout(1, 1, 2), Layout(1, 1, 4), Layout(2, 1, 4)])
def test_a_small_vocabulary_keeps_the_even_split(lay):
    assert split_of(TINY_VOCAB, lay)[1] == (32 // lay.pp,) * lay.pp


def test_identical_stages_give_the_one_f_one_b_makespan():
    rng = np.random.default_rng(0)
    f, b = rng.uniform(1, 2, 9).tolist(), rng.uniform(2, 4, 9).tolist()
    for pp in (1, 2, 4):
        want = one_f_one_b(f, b, pp).makespan
        assert one_f_one_b_stages([f] * pp, [b] * pp, pp).makespan == pytest.approx(want, rel=1e-12)


def plans(model, lengths, **kw):
    p = make_planner("adaptive", model, H8, max_seq_len=max(lengths), global_batch_tokens=sum(lengths),
                     length_sample=SAMPLE, layouts=["2xtp1cp1pp4"], **kw)
    ids = list(range(len(lengths)))
    it = p.plan(0, ids, lengths)
    return p, it, simulate_iteration(p.cm, it, dict(zip(ids, lengths)))


def test_planner_emits_its_split_and_the_simulator_honours_it():
    lengths = [8000, 8000, 6000, 4000, 4000, 2000, 2000, 1000] * 6
    p_even, even, r_even = plans(BIG_VOCAB, lengths, uneven_stages="even")
    p_on, on, r_on = plans(BIG_VOCAB, lengths, uneven_stages=True)
    split = p_on.cm.stage_splits[Layout(1, 1, 4)]
    assert split != (8, 8, 8, 8)
    for it, p in ((even, p_even), (on, p_on)):
        validate_iteration(it, 8, 32, 32, 32)
        types = set(p.replica_types())
        for r in it.replicas:
            assert r.stage_layers and r.replica_type in types
            assert r.replica_type.stage_range(3, 32) == r.stage_bounds(32)[3]
    assert all(r.stage_layers == list(split) for r in on.replicas)
    assert all(r.stage_layers == [8] * 4 for r in even.replicas)
    assert r_on.memory_ok and r_even.memory_ok
    assert r_on.time_s < r_even.time_s  # balancing the stages, the same pricing
    assert on.predicted_time_s == pytest.approx(r_on.time_s, rel=1e-6)
    assert lower_bound_v2(p_on.cm, lengths) <= r_on.time_s * (1 + 1e-9)
    assert Plan(H8.to_json(), BIG_VOCAB.to_json(), [on]).to_json()["schema"] == "dcp-plan/v2"


def test_a_small_vocabulary_plans_the_same_with_uneven_stages_on_as_with_even():
    lengths = [8000, 6000, 4000, 2000, 1000] * 6
    _, even, r_even = plans(TINY_VOCAB, lengths, uneven_stages="even")
    _, on, r_on = plans(TINY_VOCAB, lengths, uneven_stages="on")
    assert Plan({}, {}, [on]).to_json() == Plan({}, {}, [even]).to_json()
    assert r_on.time_s == r_even.time_s


def test_uneven_stages_off_writes_v1_plans():
    lengths = [8000, 6000, 4000, 2000, 1000] * 6
    p, it, _ = plans(BIG_VOCAB, lengths)
    assert not p.cm.stage_splits
    assert all(r.stage_layers is None for r in it.replicas)
    assert all(t.stage_layers is None for t in p.replica_types())
    assert Plan({}, {}, [it]).to_json()["schema"] == "dcp-plan/v1"


def test_deep_pipelines_move_only_the_first_and_last_stage():
    """pp > 2: megatron-core builds [first, m, ..., m, last]; the split keeps that shape and
    still lightens the stages that carry the embedding and the logits."""
    from dcp_ext.planning.planners.stage_split import _fastest

    split = _fastest([5.0, 0.0, 0.0, 9.0], 1.0, 32, [29] * 4)
    assert len(set(split[1:-1])) == 1 and sum(split) == 32
    assert split[-1] < split[1] and split[0] < split[1]
    assert _fastest([0.0, 0.0, 0.0], 1.0, 9, [7] * 3) == [3, 3, 3]


def test_dcp_plan_flags_reach_the_adaptive_planner_only(tmp_path, monkeypatch):
    """dcp-plan's --dcp-uneven-stages / --dcp-layer-strategies become the adaptive planner's
    options (the baselines get none); the plans written validate; without the flags, v1."""
    import json

    from dcp_ext.cli import plan as plan_cli

    seen = []
    real = plan_cli.make_planner

    def spy(name, *a, **kw):
        seen.append((name, {k: kw[k] for k in ("layer_strategies", "uneven_stages") if k in kw}))
        return real(name, *a, **kw)

    monkeypatch.setattr(plan_cli, "make_planner", spy)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in [8000, 6000, 4000, 2000, 1000, 500] * 40))
    out = tmp_path / "plan.json"
    argv = ["--lengths", str(lengths), "--model", "llama2-7b", "--cluster", "h200x8", "--global-batch-tokens",
            "131072", "--max-seq-len", "8192", "--iterations", "2", "--quiet", "--out", str(out)]
    flags = ["--dcp-uneven-stages", "on", "--dcp-layer-strategies", "on"]
    assert plan_cli.main(argv + flags) == 0
    assert plan_cli.main(argv + flags + ["--planner", "static"]) == 0
    assert seen == [("adaptive", {"layer_strategies": "on", "uneven_stages": "on"}), ("static", {})]
    assert plan_cli.main(argv + flags) == 0
    for it in Plan.load(str(out)).iterations:
        validate_iteration(it, 8, 32, 32, 32)
    assert plan_cli.main(argv) == 0
    assert json.loads(out.read_text())["schema"] == "dcp-plan/v1"

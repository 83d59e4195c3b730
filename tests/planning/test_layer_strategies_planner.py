"""Layer strategies (plan contract v2) in the adaptive planner: priced like v1 where they
change nothing, emitted only when they lower the predicted time or replace recompute, and
every plan valid and within memory by the simulator. Pure and fast: fixed layout pools."""
import numpy as np
import pytest

from dcp_ext.planning.bound_v2 import lower_bound_v2
from dcp_ext.planning.cost_model import CostModel
from dcp_ext.planning.layer_cost import LayerPrices, micro_batch_stage_times, refactorings
from dcp_ext.planning.layer_memory import replica_peak_v2
from dcp_ext.planning.layout import Layout
from dcp_ext.planning.plan import LayerStrategy, Plan, validate_iteration
from dcp_ext.planning.planner import make_planner
from dcp_ext.planning.simulator import lower_bound, simulate_iteration
from dcp_ext.planning.specs import ClusterSpec, ModelSpec

MODEL = ModelSpec.from_preset("llama2-7b")
H8 = ClusterSpec.from_preset("h200x8")


def plan_one(model, cluster, lengths, layouts, **kw):
    p = make_planner("adaptive", model, cluster, max_seq_len=max(lengths), global_batch_tokens=sum(lengths),
                     length_sample=lengths * 4, layouts=layouts, **kw)
    ids = list(range(len(lengths)))
    it = p.plan(0, ids, lengths)  # plan(): validated, within memory (the simulator's check)
    res = simulate_iteration(p.cm, it, dict(zip(ids, lengths)))
    return p, it, res


def layered(it):
    return [mb for r in it.replicas for mb in r.micro_batches if mb.layer_strategies]


@pytest.mark.parametrize("model,cluster", [("llama2-7b", "h200x64"), ("demo", "cpu-gloox4"), ("gpt-1.3b", "h100x8")])
def test_home_everywhere_is_priced_as_v1(model, cluster):
    """A micro-batch whose strategies all name the replica's own (tp, cp) costs what the cost
    model says, in time and in memory (layers and fixed parts add up to the stage)."""
    cm = CostModel(ModelSpec.from_preset(model), ClusterSpec.from_preset(cluster))
    lp = LayerPrices(cm)
    L = cm.model.num_layers
    lens = [3000, 7000, 120]
    s = np.asarray(lens, dtype=float)
    stats = (float(s @ s), float(s.sum()), len(s))
    for lay in cm.all_layouts()[:30]:
        home = [LayerStrategy(0, L - 1, lay.tp, lay.cp)]
        for R in (0, lay.pp, L):
            want = cm.coeffs(lay, cm.stage_recompute(lay, R)).mb_fwd_bwd(*stats)
            f, b = micro_batch_stage_times(lp, lay, None, stats, R, home)
            assert f == pytest.approx([want[0]] * lay.pp, rel=1e-9)
            assert b == pytest.approx([want[1]] * lay.pp, rel=1e-9)
            padded = cm.padded_lengths(lay, lens)
            tokens = float(sum(padded)) if cm.quadratic(lay) else float(sum(lens))
            mbs = [(tokens, R, home, padded)] * 3
            want_mem = cm.replica_peak_bytes(lay, [tokens] * 3, [cm.stage_recompute(lay, R)] * 3,
                                             mb_lengths=[padded] * 3)
            assert replica_peak_v2(cm, lay, None, mbs) == pytest.approx(want_mem, rel=1e-9)


def test_a_long_document_moves_its_layers_when_that_is_faster():
    """tp8 on one node: a 64K-token document's layers run faster as more CP, less TP (no TP
    collectives, the key/value exchange hidden under attention): the planner moves them, the
    plan is valid, within memory, and faster than without layer strategies."""
    lengths = [65536]
    _, off, r_off = plan_one(MODEL, H8, lengths, ["1xtp8cp1pp1"])
    p, on, r_on = plan_one(MODEL, H8, lengths, ["1xtp8cp1pp1"], layer_strategies=True)
    assert not layered(off)
    mbs = layered(on)
    assert mbs, "the long document kept tp8 on every layer"
    assert r_on.time_s < r_off.time_s
    assert r_on.memory_ok
    lp = LayerPrices(p.cm)
    s2, T = float(lengths[0]) ** 2, float(lengths[0])
    home = sum(x[0] for x in lp.layer_times((8, 1), 1, [s2], [T], [1]))
    for st in mbs[0].layer_strategies:
        if (st.tp, st.cp) != (8, 1):
            assert sum(x[0] for x in lp.layer_times((st.tp, st.cp), 1, [s2], [T], [1])) < home
    assert on.predicted_time_s == pytest.approx(r_on.time_s, rel=1e-6)
    # v2 JSON round trip, and the widened bound stays below the plan
    back = Plan.from_json(Plan(H8.to_json(), MODEL.to_json(), [on]).to_json())
    assert back.to_json()["schema"] == "dcp-plan/v2"
    assert back.iterations[0].replicas[0].micro_batches[0].layer_strategies == mbs[0].layer_strategies
    assert lower_bound_v2(p.cm, lengths) <= r_on.time_s * (1 + 1e-9)


def test_no_move_when_no_strategy_is_faster():
    """With collectives that cost nothing, tp8 is the fastest way to run every layer (the
    fewest rows per GEMM constant): nothing moves and the plan is the one without the feature."""
    fast = H8.with_(intra_node_bw=1e18, intra_node_latency=0.0)
    lengths = [65536, 4096, 4096, 900]
    _, off, _ = plan_one(MODEL, fast, lengths, ["1xtp8cp1pp1"])
    _, on, _ = plan_one(MODEL, fast, lengths, ["1xtp8cp1pp1"], layer_strategies=True)
    assert not layered(on)
    assert Plan({}, {}, [on]).to_json() == Plan({}, {}, [off]).to_json()


def test_moving_layers_replaces_recompute_where_memory_binds():
    """Without sequence parallelism tp8 keeps the layer inputs of the whole sequence on each
    TP rank; a document that needs recompute there fits with less once layers run as CP.
    Memory first: the planner moves layers and recomputes fewer of them."""
    model = MODEL.with_(sequence_parallel=False)
    cm = CostModel(model, H8)
    n = int(cm.max_tokens(Layout(8, 1, 1), 0, 1) * 1.5)
    _, off, r_off = plan_one(model, H8, [n], ["1xtp8cp1pp1"])
    _, on, r_on = plan_one(model, H8, [n], ["1xtp8cp1pp1"], layer_strategies=True)
    rec_off = off.replicas[0].micro_batches[0].recompute_layers
    rec_on = on.replicas[0].micro_batches[0].recompute_layers
    assert rec_off > 0
    assert layered(on) and rec_on < rec_off
    assert r_on.time_s < r_off.time_s and r_on.memory_ok


def test_long_mixed_batch_plans_are_valid_and_above_the_widened_bound():
    """A 64-GPU batch of long and short documents: every plan validates, fits memory, and
    no plan (with or without layer strategies) beats bound_v2; bound_v2 <= the v1 bound."""
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in np.minimum(rng.lognormal(8.0, 1.6, 900).astype(int) + 16, 262144)]
    cluster = ClusterSpec.from_preset("h200x64")
    pools = ["1xtp8cp4pp1+4xtp2cp2pp1+16xtp1cp1pp1", "2xtp4cp4pp1+4xtp1cp4pp1+16xtp1cp1pp1"]
    times = {}
    for kw in ({}, {"layer_strategies": True}):
        p, it, res = plan_one(MODEL, cluster, lengths, pools, **kw)
        validate_iteration(it, 64, MODEL.num_layers, MODEL.num_attention_heads, MODEL.num_query_groups)
        assert res.memory_ok
        times[bool(kw)] = res.time_s
        for r in it.replicas:
            home = (r.tp, r.cp)
            for mb in r.micro_batches:
                for st in mb.layer_strategies or ():
                    assert (st.tp, st.cp) in refactorings(p.cm, *home)
    lb1 = lower_bound(p.cm, lengths)
    lb2 = lower_bound_v2(p.cm, lengths)
    assert lb2 <= lb1 * (1 + 1e-9)
    assert min(times.values()) >= lb2 * (1 - 1e-9)
    assert times[True] <= times[False] * (1 + 1e-9)  # the v2 pass keeps a replica only if it is faster


def test_features_off_by_default_and_spelled_off_are_the_same_planner():
    lengths = [5000, 3000, 70000, 1200]
    _, a, _ = plan_one(MODEL, H8, lengths, ["1xtp8cp1pp1", "2xtp2cp2pp1"])
    _, b, _ = plan_one(MODEL, H8, lengths, ["1xtp8cp1pp1", "2xtp2cp2pp1"], layer_strategies="off",
                       uneven_stages=False)
    assert Plan({}, {}, [a]).to_json() == Plan({}, {}, [b]).to_json()
    assert Plan({}, {}, [a]).to_json()["schema"] == "dcp-plan/v1"
    with pytest.raises(ValueError):
        plan_one(MODEL, H8, lengths, ["1xtp8cp1pp1"], layer_strategies="sometimes")

"""The runtime's memory does not grow with its pool, and the cost model charges what it holds.

On 4 gloo ranks: an engine whose pool puts 7 replica types on every rank holds (by its
own count, and by the storages its stages' parameters really live in) within 10% of an
engine with one replica type per rank; every stage's parameters and main grads are views
of the rank's two shared buffers; and the cost model's `state_bytes` for the pool (after
`charge_shared_buffers`) is within 5% of the worst rank's persistent bytes.
"""
import pytest

from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

R = (0, 1, 2, 3)
ONE = [((r,), 1, 1, 1) for r in R]
# 7 types on every rank: alone, TP2, CP2, PP2, TP4, TP2xPP2, CP2xTP2
MANY = ONE + [((0, 1), 2, 1, 1), ((2, 3), 2, 1, 1), ((0, 1), 1, 2, 1), ((2, 3), 1, 2, 1), ((0, 1), 1, 1, 2),
              ((2, 3), 1, 1, 2), (R, 4, 1, 1), (R, 2, 1, 2), (R, 2, 2, 1)]


def _worker(rank, world, which):
    from dcp_ext.planning.layout import ReplicaType
    from tests.support.runtime_helpers import make_engine, tiny_args

    pool = {"one": ONE, "many": MANY}[which]
    types = [ReplicaType(tp, cp, pp, ranks) for ranks, tp, cp, pp in pool]
    engine = make_engine(tiny_args(world), types, overlap=True)
    shared = {engine.bank.params.untyped_storage().data_ptr(), engine.bank.main_grads.untyped_storage().data_ptr()}
    storages = {lp.param.untyped_storage().data_ptr() for st in engine.bank.stages.values() for lp in st.local}
    storages |= {lp.param.main_grad.untyped_storage().data_ptr() for st in engine.bank.stages.values() for lp in st.local}
    return {"types_here": len(engine.bank.stages), "bytes": engine.persistent_bytes(),
            "foreign_storages": len(storages - shared)}


def _cost_model_bytes(pool):
    from dcp_ext.planning.cost_model import CostModel, Layout
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import model_spec_for
    from tests.support.runtime_helpers import tiny_args

    args = tiny_args(4)
    args.overlap_param_gather = True
    cm = CostModel(model_spec_for(args), ClusterSpec.cpu_gloo(4))
    layouts = {Layout(tp, cp, pp) for _, tp, cp, pp in pool}
    cm.charge_shared_buffers(layouts)
    return max(cm.state_bytes(lay) for lay in layouts)


def test_pool_of_seven_types_per_rank_holds_what_a_pool_of_one_holds():
    one = run_ranks(4, fn=_worker, args=("one",))
    many = run_ranks(4, fn=_worker, args=("many",))
    for rank in range(4):
        assert one[rank]["types_here"] == 1 and many[rank]["types_here"] == 7
        assert many[rank]["foreign_storages"] == 0, "a stage owns parameter or gradient storage of its own"
        a, b = sum(one[rank]["bytes"].values()), sum(many[rank]["bytes"].values())
        assert b <= 1.10 * a, (rank, one[rank]["bytes"], many[rank]["bytes"])
    worst = max(sum(r["bytes"].values()) for r in many)
    predicted = _cost_model_bytes(MANY)
    assert predicted == pytest.approx(worst, rel=0.05), (predicted, [r["bytes"] for r in many])

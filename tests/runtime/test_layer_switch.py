"""Layer-wise strategy switching and uneven pipeline stages train the same model.

On 2 gloo ranks, fp32: a TP2 replica whose micro-batches run layers 0 | 1-2 | 3 as
TP2 -> CP2 -> TP2 (with and without sequence parallelism; one micro-batch also
recomputing, one CP2 -> TP2 -> CP2 the other way round, one unswitched), and a PP2
replica split 3+1 then 1+3, each step against the single-process reference: loss,
gradient norm, pushed gradients and updated parameters within 1e-5. Plus the re-layout
rule itself (pure): every token reaches every rank that holds it next.
"""
import pytest
import torch

from dcp_ext.runtime.schedule.layer_switch import build_route, positions
from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("a,b", [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (1, 4)), ((4, 1), (2, 2))])
def test_relayout_routes_every_token_to_its_next_holder(a, b, sp):
    padded = [8, 16, 24]
    n = a[0] * a[1]
    before = [positions(padded, a, sp, i) for i in range(n)]
    after = [positions(padded, b, sp, i) for i in range(n)]
    order = list(range(n))
    routes = [build_route(before, after, me, order) for me in range(n)]
    # simulate the all-to-all on values = token ids
    for d in range(n):
        out = torch.full((routes[d].out_rows,), -1)
        got = []
        for s in range(n):
            sent = before[s][routes[s].send_index]
            off = sum(routes[s].send_counts[:d])
            got.append(sent[off : off + routes[s].send_counts[d]])
        out[routes[d].recv_index] = torch.cat(got)
        assert torch.equal(out, after[d]), (d, out, after[d])


def _plan(index, docs_n, replica, switched):
    from dcp_ext.planning.plan import IterationPlan, LayerStrategy, MicroBatchPlan, ReplicaPlan

    ranks, tp, cp, pp, stage_layers = replica
    ids = list(range(docs_n))
    mbs = [MicroBatchPlan(ids[k::4], 0) for k in range(4)]
    if switched:
        other = (1, 2) if (tp, cp) == (2, 1) else (2, 1)
        mbs[0].layer_strategies = [LayerStrategy(0, 0, tp, cp), LayerStrategy(1, 2, *other), LayerStrategy(3, 3, tp, cp)]
        mbs[1].layer_strategies = [LayerStrategy(0, 1, *other), LayerStrategy(2, 3, tp, cp)]
        mbs[1].recompute_layers = 4
        mbs[2].layer_strategies = [LayerStrategy(0, 3, *other)]
    return IterationPlan(index, ids, [ReplicaPlan(list(ranks), tp, cp, pp, mbs, stage_layers=stage_layers)])


def _worker(rank, world, sequence_parallel):
    from dcp_ext.planning.layout import ReplicaType
    from tests.support.runtime_helpers import Reference, engine_step, make_engine, random_docs, tiny_args
    from tests.runtime.test_layout_equivalence import _reference_step, _relative_error, step_errors

    cases = {
        "TP2 switching": ((0, 1), 2, 1, 1, None, True),
        "CP2 switching": ((0, 1), 1, 2, 1, None, True),
        "PP2 3+1": ((0, 1), 1, 1, 2, [3, 1], False),
        "PP2 1+3": ((0, 1), 1, 1, 2, [1, 3], False),
    }
    args = tiny_args(world)
    types = [ReplicaType(tp, cp, pp, ranks, tuple(sl) if sl else None) for ranks, tp, cp, pp, sl, _ in cases.values()]
    engine = make_engine(args, types, sequence_parallel=sequence_parallel, layer_strategies=True,
                         bucket_numel=20000)
    init = engine.gather_canonical()
    report = {}
    for i, (name, (*replica, switched)) in enumerate(cases.items()):
        docs = random_docs(12, seed=40 + i)
        engine.set_canonical(init, reset_optimizer=True)
        got = engine_step(engine, _plan(0, len(docs), replica, switched), docs)
        rep = types[i]
        built = len(engine.bank.stages[rep].runner.model.decoder.layers)
        bound = sum(p.numel() for alt in engine.bank.alternatives[rep].values() for p in alt.model.parameters())
        report[name] = {"built": built, "bound": bound,
                        **step_errors(engine, got, Reference(engine, args, init) if rank == 0 else None, docs)}
    # two steps in a row: the second binds other alternative layers than the first
    engine.set_canonical(init, reset_optimizer=True)
    ref = Reference(engine, args, init) if rank == 0 else None
    worst = 0.0
    for step, name in enumerate(["TP2 switching", "PP2 3+1", "CP2 switching"]):
        docs = random_docs(12, seed=90 + step)
        *replica, switched = cases[name]
        got = engine_step(engine, _plan(step, len(docs), replica, switched), docs)
        loss, norm, _, ref_params = _reference_step(ref, docs, engine.space.numel)
        worst = max(worst, abs(got.loss - loss) / abs(loss), abs(got.grad_norm - norm) / norm)
    report["sequence"] = {"loss_norm": worst, "params": _relative_error(engine.gather_canonical(), ref_params)}
    return report


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_switching_and_uneven_stages_match_single_process_reference(sequence_parallel):
    reports = run_ranks(2, fn=_worker, args=(sequence_parallel,))
    for rank, report in enumerate(reports):
        # the stages were built uneven, and switching bound alternative layers (only then)
        assert report["PP2 3+1"]["built"] == [3, 1][rank] and report["PP2 1+3"]["built"] == [1, 3][rank]
        assert report["TP2 switching"]["bound"] > 0 and report["CP2 switching"]["bound"] > 0
        assert report["PP2 3+1"]["bound"] == 0
        for name, errors in report.items():
            for what, err in errors.items():
                if what not in ("built", "bound"):
                    assert err < 1e-5, (rank, name, what, err)


def _pipelined_worker(rank, world):
    from dcp_ext.planning.layout import ReplicaType
    from dcp_ext.planning.plan import IterationPlan, LayerStrategy, MicroBatchPlan, ReplicaPlan
    from tests.support.runtime_helpers import InMemoryDocuments, Reference, engine_step, make_engine, random_docs, tiny_args
    from tests.runtime.test_layout_equivalence import _reference_step

    args = tiny_args(world)
    home = ReplicaType(2, 1, 2, (0, 1, 2, 3), (1, 3))
    # small buckets and the overlapped pull/push: alternative layers wait for their buckets too
    engine = make_engine(args, [home], sequence_parallel=True, layer_strategies=True, overlap=True,
                         bucket_numel=3000)
    init = engine.gather_canonical()
    docs = random_docs(10, seed=7)
    ids = list(range(len(docs)))
    mbs = [MicroBatchPlan(ids[k::3], 0) for k in range(3)]
    # layer 0 (stage 0) as CP2; stage 1: layer 1 TP2, layers 2-3 CP2
    mbs[0].layer_strategies = [LayerStrategy(0, 0, 1, 2), LayerStrategy(1, 1, 2, 1), LayerStrategy(2, 3, 1, 2)]
    mbs[2].layer_strategies = [LayerStrategy(0, 2, 2, 1), LayerStrategy(3, 3, 1, 2)]
    mbs[2].recompute_layers = 2
    plan = IterationPlan(0, ids, [ReplicaPlan([0, 1, 2, 3], 2, 1, 2, mbs, stage_layers=[1, 3])])
    loss_sum, tokens = engine.eval_iteration(plan, InMemoryDocuments(docs))
    got = engine_step(engine, plan, docs)
    ref = Reference(engine, args, init) if rank == 0 else None
    loss, norm, _, ref_params = _reference_step(ref, docs, engine.space.numel)
    return {"eval": abs(loss_sum / tokens - loss) / loss, "loss": abs(got.loss - loss) / loss,
            "norm": abs(got.grad_norm - norm) / norm,
            "params": float((engine.gather_canonical() - ref_params).abs().max() / ref_params.abs().max())}


def test_switching_inside_uneven_pipeline_stages_matches_reference():
    """TP2·PP2 split 1+3 with sequence parallelism and overlapped pull/push, layers switching
    to CP2 on both stages; evaluation and one training step against the reference."""
    for rank, report in enumerate(run_ranks(4, fn=_pipelined_worker)):
        for what, err in report.items():
            assert err < 1e-5, (rank, what, err)


def _planned_worker(rank, world):
    """The adaptive planner's own v2 plans (tiny model priced as if on two H200s, tp2 pool:
    it moves layers of micro-batches to CP2), executed by the engine on gloo."""
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import model_spec_for
    from tests.support.runtime_helpers import Reference, engine_step, make_engine, random_docs, tiny_args
    from tests.runtime.test_layout_equivalence import step_errors

    args = tiny_args(world)
    docs = random_docs(12, seed=3, lo=20, hi=250)
    lengths = [len(d) for d in docs]
    planner = make_planner("adaptive", model_spec_for(args), ClusterSpec.from_preset("h200x2"),
                           max_seq_len=max(lengths), global_batch_tokens=sum(lengths), length_sample=lengths * 4,
                           layouts=["1xtp2cp1pp1"], layer_strategies=True)
    plan = planner.plan(0, list(range(len(docs))), lengths)
    engine = make_engine(args, planner.replica_types(), sequence_parallel=True, layer_strategies=True)
    init = engine.gather_canonical()
    got = engine_step(engine, plan, docs)
    switched = sum(1 for r in plan.replicas for mb in r.micro_batches if mb.layer_strategies)
    return {"switched": switched, **step_errors(engine, got, Reference(engine, args, init) if rank == 0 else None, docs)}


def test_the_planners_layer_strategies_run_and_match_reference():
    for rank, report in enumerate(run_ranks(2, fn=_planned_worker)):
        assert report.pop("switched") > 0, "the planner emitted no layer strategies: the test checks nothing"
        for what, err in report.items():
            assert err < 1e-5, (rank, what, err)

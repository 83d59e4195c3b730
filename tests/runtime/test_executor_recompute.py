"""Recompute chosen per micro-batch really recomputes: with `recompute_layers` = L every
transformer layer runs its forward twice (once more in backward), with 0 once; the
gradients are the same either way."""
import pytest

from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist


def _worker(rank, world):
    import torch

    from dcp_ext.planning.plan import IterationPlan, MicroBatchPlan, ReplicaPlan
    from dcp_ext.planning.layout import ReplicaType
    from tests.support.runtime_helpers import engine_step, make_engine, random_docs, tiny_args

    args = tiny_args(world)
    engine = make_engine(args, [ReplicaType(1, 1, 1, (0,))])
    init = engine.gather_canonical()
    model = engine.bank.stages[ReplicaType(1, 1, 1, (0,))].runner.model
    calls = []
    for layer in model.decoder.layers:
        layer.register_forward_hook(lambda *a: calls.append(1))
    docs = random_docs(4, seed=3)
    out = {}
    for recompute in (0, args.num_layers):
        calls.clear()
        engine.set_canonical(init, reset_optimizer=True)
        plan = IterationPlan(0, [0, 1, 2, 3], [ReplicaPlan([0], 1, 1, 1, [MicroBatchPlan([0, 1], recompute),
                                                                              MicroBatchPlan([2, 3], recompute)])])
        engine_step(engine, plan, docs)
        out[recompute] = (len(calls), engine.server.exchange.allgather(engine.optimizer.grad))
    return {"calls": [out[0][0], out[args.num_layers][0]], "layers": args.num_layers,
            "grad_diff": float((out[0][1] - out[args.num_layers][1]).abs().max())}


def test_recompute_per_micro_batch_reruns_layers_and_keeps_gradients():
    (report,) = run_ranks(1, fn=_worker)
    layers = report["layers"]
    assert report["calls"] == [2 * layers, 4 * layers]  # 2 micro-batches; recompute doubles the forwards
    assert report["grad_diff"] < 1e-6

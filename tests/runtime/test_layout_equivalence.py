"""The adaptive runtime trains the same model under every layout.

On 4 gloo ranks, one global batch of variable-length documents; after one step under each
layout, loss, gradient norm and every updated parameter equal a single-process plain-torch
reference (fp32, 1e-5 relative); then 5 steps with a different layout at each step. The
reference runs on rank 0 alone and is broadcast, so every rank checks its own results
against it.
"""
import pytest

from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

R = list(range(4))
LAYOUTS = {
    "4xDP": [([0], 1, 1, 1, 2), ([1], 1, 1, 1, 1), ([2], 1, 1, 1, 2), ([3], 1, 1, 1, 1)],
    "2xTP2": [([0, 1], 2, 1, 1, 2), ([2, 3], 2, 1, 1, 1)],
    "2xPP2": [([0, 1], 1, 1, 2, 3), ([2, 3], 1, 1, 2, 2)],
    "2xCP2": [([0, 1], 1, 2, 1, 2), ([2, 3], 1, 2, 1, 1)],
    "TP2+2xTP1": [([0, 1], 2, 1, 1, 2), ([2], 1, 1, 1, 1), ([3], 1, 1, 1, 2)],
    "PP2+CP2": [([0, 1], 1, 1, 2, 3), ([2, 3], 1, 2, 1, 1)],
    "TP2.PP2": [(R, 2, 1, 2, 3)],
    "TP4": [(R, 4, 1, 1, 2)],
}
SEQUENCE = ["TP2+2xTP1", "2xPP2", "TP4", "PP2+CP2", "4xDP"]


def _types(layouts):
    from dcp_ext.planning.layout import ReplicaType

    return {ReplicaType(tp, cp, pp, tuple(ranks)) for lay in layouts for ranks, tp, cp, pp, _ in lay}


def _relative_error(a, b):
    import torch

    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _reference_step(ref, docs, numel):
    """Rank 0 steps the reference (None elsewhere); every rank gets (loss, norm, grad, params)."""
    import torch
    import torch.distributed as dist

    buf = torch.empty(2 + 2 * numel, dtype=torch.float64)
    if ref is not None:
        loss, norm = ref.step(docs)
        buf[0], buf[1] = loss, norm
        buf[2 : 2 + numel] = ref.last_grad
        buf[2 + numel :] = ref.flat()
    dist.broadcast(buf, src=0)
    return float(buf[0]), float(buf[1]), buf[2 : 2 + numel].float(), buf[2 + numel :].float()


def step_errors(engine, got, ref, docs) -> dict:
    """Relative errors of one engine step against the reference's step on the same docs:
    loss, gradient norm, pushed gradients, updated parameters."""
    loss, norm, ref_grad, ref_params = _reference_step(ref, docs, engine.space.numel)
    pushed = engine.server.exchange.allgather(engine.optimizer.grad)
    return {
        "loss": abs(got.loss - loss) / abs(loss),
        "norm": abs(got.grad_norm - norm) / norm,
        "grads": _relative_error(pushed, ref_grad),
        "params": _relative_error(engine.gather_canonical(), ref_params),
    }


def _worker(rank, world, sequence_parallel, exchange, overlap):
    from tests.support.runtime_helpers import Reference, engine_step, make_engine, plan_for, random_docs, tiny_args

    args = tiny_args(world)
    # small buckets (many per layer) so the overlapped pull/push really interleave with compute
    engine = make_engine(args, _types(LAYOUTS.values()), sequence_parallel=sequence_parallel, exchange=exchange,
                         overlap=overlap, bucket_numel=5000 if overlap else None)
    init = engine.gather_canonical()
    report = {"groups": engine.registry.num_groups}
    # one step under each layout, from the same start
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        docs = random_docs(14, seed=i)
        engine.set_canonical(init, reset_optimizer=True)
        got = engine_step(engine, plan_for(0, layout, len(docs), recompute_every=3), docs)
        report[name] = step_errors(engine, got, Reference(engine, args, init) if rank == 0 else None, docs)
    # five steps, a different layout each
    engine.set_canonical(init, reset_optimizer=True)
    ref = Reference(engine, args, init) if rank == 0 else None
    worst = 0.0
    for step, name in enumerate(SEQUENCE):
        docs = random_docs(12, seed=100 + step)
        got = engine_step(engine, plan_for(step, LAYOUTS[name], len(docs)), docs)
        loss, norm, _, ref_params = _reference_step(ref, docs, engine.space.numel)
        worst = max(worst, abs(got.loss - loss) / abs(loss), abs(got.grad_norm - norm) / norm)
    report["sequence"] = {"loss_norm": worst, "params": _relative_error(engine.gather_canonical(), ref_params)}
    report["bytes"] = [engine.server.exchange.bytes_pulled, engine.server.exchange.bytes_pushed]
    return report


@pytest.mark.parametrize("sequence_parallel,exchange,overlap",
                         [(False, "targeted", False), (True, "allgather", False), (True, "targeted", True)])
def test_every_layout_matches_single_process_reference(sequence_parallel, exchange, overlap):
    reports = run_ranks(4, fn=_worker, args=(sequence_parallel, exchange, overlap))
    for rank, report in enumerate(reports):
        for name in list(LAYOUTS) + ["sequence"]:
            for what, err in report[name].items():
                assert err < 1e-5, (rank, name, what, err)
    # groups are built once, bounded by the replica types
    assert reports[0]["groups"] < 40

"""The parameter server hands out and takes back its state in canonical tensors (issue 39).

Why it exists: checkpoints read and write files over `ParameterServer.canonical_state` and
`load_canonical_state`, which alone hold the shard arithmetic. On 2 ranks after two steps:
every canonical tensor of every kind comes out whole on exactly one rank (the owner of its
first element) and equals the slice of the gathered master vector; a server with other initial
values that loads them holds the same weights, moments and step count, and takes the same next
step; loading the weights alone leaves the optimizer's own moments.
"""
import pytest

from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

LAYOUT = [([0], 1, 1, 1, 2), ([1], 1, 1, 1, 1)]  # two one-rank replicas


def _worker(rank, world):
    import torch
    import torch.distributed as dist

    from dcp_ext.planning.layout import ReplicaType
    from tests.support.runtime_helpers import engine_step, make_engine, plan_for, random_docs, tiny_args

    args = tiny_args(world)
    types = [ReplicaType(1, 1, 1, (r,)) for r in range(world)]
    docs = random_docs(8, seed=5)
    a = make_engine(args, types, init_seed=1)
    for i in range(2):
        engine_step(a, plan_for(i, LAYOUT, len(docs)), docs)
    flat = a.gather_canonical()
    out = {}
    for name, kind, value in a.server.canonical_state():
        if value is not None:
            out[name, kind] = value.clone()
    # every rank's pieces, so each can read any tensor (what the files give a loading rank)
    parts = [None] * world
    dist.all_gather_object(parts, out)
    whole = {k: v for p in parts for k, v in p.items()}
    owners = sum(len(p) for p in parts)
    space = a.server.canonical_shapes()
    params_match = all(torch.equal(whole[name, "param"].flatten(),
                                   flat[t.offset: t.offset + t.numel].cpu())
                       for name, _ in space for t in [a.space.tensors[name]])

    b = make_engine(args, types, init_seed=2)
    differs_before = not torch.equal(b.gather_canonical(), flat)
    b.server.load_canonical_state(lambda group: {(t.name, k): whole[t.name, k] for t in group
                                                 for k in ("param", "exp_avg", "exp_avg_sq")},
                                  adam_step=a.optimizer.step_count(), group_numel=1000)
    ma, mb = a.optimizer.moments(), b.optimizer.moments()
    same_state = (torch.equal(b.gather_canonical(), flat) and torch.equal(ma[0], mb[0]) and torch.equal(ma[1], mb[1])
                  and ma[2] == mb[2] == b.optimizer.step_count() == 2)
    ra = engine_step(a, plan_for(2, LAYOUT, len(docs)), docs)
    rb = engine_step(b, plan_for(2, LAYOUT, len(docs)), docs)
    same_step = ra.loss_sum == rb.loss_sum and torch.equal(a.gather_canonical(), b.gather_canonical())

    c = make_engine(args, types, init_seed=3)
    c.server.load_canonical_state(lambda group: {(t.name, "param"): whole[t.name, "param"] for t in group},
                                  ("param",))
    avg, avg_sq, step = c.optimizer.moments()
    weights_only = (torch.equal(c.gather_canonical(), flat) and step == 0 and not avg.any() and not avg_sq.any())
    return {"owners": owners, "expected": 3 * len(space), "params_match": params_match,
            "differs_before": differs_before, "same_state": same_state, "same_step": same_step,
            "weights_only": weights_only}


def test_the_state_in_canonical_tensors_goes_out_and_back_exactly():
    for report in run_ranks(2, fn=_worker):
        assert report["owners"] == report["expected"]  # each tensor and kind on exactly one rank
        assert report["params_match"]
        assert report["differs_before"]  # the second server started elsewhere
        assert report["same_state"]
        assert report["same_step"]
        assert report["weights_only"]

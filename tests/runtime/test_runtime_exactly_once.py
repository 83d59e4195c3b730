"""Exactly once: over 50 iterations of the adaptive planner on a real
length distribution, every sample's tokens enter the loss exactly once.

Each document's loss mask is weighted by its own value w_i = 1 + i/997, so the
executor's sum of loss-mask weights equals sum_i w_i (L_i - 1) only if every document of
the global batch was trained once: a dropped or doubled document changes the sum.
"""
import pytest

from dcp_ext.data.lengths import read_lengths
from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist


def _worker(rank, world, lengths):
    import numpy as np

    from dcp_ext.planning.batching import global_batches
    from dcp_ext.data.thd import build_micro_batch
    from dcp_ext.planning.plan import validate_iteration
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec
    from megatron.training.adaptive.run_config import model_spec_for
    from tests.support.runtime_helpers import VOCAB, make_engine, tiny_args

    args = tiny_args(world)
    max_len, batch_tokens = 256, 1024
    planner = make_planner("adaptive", model_spec_for(args), ClusterSpec.cpu_gloo(world),
                           max_seq_len=max_len, global_batch_tokens=batch_tokens, length_sample=lengths, seed=0)
    engine = make_engine(args, planner.replica_types())
    rng = np.random.default_rng(0)
    truncated = [min(n, max_len) for n in lengths]
    docs = [rng.integers(0, VOCAB - 1, size=n) for n in truncated]
    weight = lambda i: 1.0 + i / 997.0  # noqa: E731
    layouts, mismatches = set(), []
    for index, ids in enumerate(global_batches(truncated, batch_tokens, max_len, count=50)):
        it = planner.plan_iteration(index, ids, [truncated[i] for i in ids])
        validate_iteration(it, world, args.num_layers, args.num_attention_heads, args.num_query_groups)
        layouts.add(tuple(sorted((r.tp, r.cp, r.pp) for r in it.replicas)))
        local = engine.local_plan(it)
        batches = []
        for mb in local.replica.micro_batches:
            b = build_micro_batch([docs[i] for i in mb.sample_ids], pad_each_to=local.pad_each_to,
                                  pad_total_to=local.pad_total_to)
            for k, i in enumerate(mb.sample_ids):  # weight each document's loss positions
                b.loss_mask[int(b.cu_seqlens_padded[k]) : int(b.cu_seqlens_padded[k + 1])] *= weight(i)
            batches.append(b)
        expected = sum(weight(i) * (truncated[i] - 1) for i in ids)
        result = engine.step(it, batches, sum(truncated[i] - 1 for i in ids))
        if abs(result.loss_tokens - expected) > 1e-6 * expected:
            mismatches.append((index, result.loss_tokens, expected))
    return {"mismatches": mismatches, "layouts": len(layouts), "iterations": index + 1}


def test_every_sample_enters_the_loss_exactly_once():
    # the real code-file distribution, scaled 1/32 to fit CPU runs (shape kept)
    lengths = [max(2, n // 32) for n in read_lengths("code_python_cl100k.txt", limit=3000)]
    reports = run_ranks(4, fn=_worker, args=(lengths,))
    for report in reports:
        assert report["iterations"] == 50
        assert report["mismatches"] == [], report["mismatches"][:3]

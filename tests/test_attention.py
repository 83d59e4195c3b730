"""Our CPU core attention against an independent dense reference: document-masked, causal,
GQA, and split over context-parallel ranks (forward and gradients)."""
import math

import pytest
import torch

from dcp_ext.runtime.attention import document_causal_attention
from dcp_ext.runtime.context_parallel import cp_token_indices
from tests.helpers import run_ranks


def dense_reference(q, k, v, lengths, scale):
    """Plain matmul + softmax with a block-diagonal causal mask over the whole pack."""
    t = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_qkv(lengths, heads=4, groups=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(t, groups, dim, generator=g, dtype=torch.float64)
    v = torch.randn(t, groups, dim, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("lengths", [[7], [3, 9, 1, 12], [16, 16]])
def test_packed_documents_match_dense_mask(lengths):
    q, k, v = random_qkv(lengths)
    scale = 1 / math.sqrt(8)
    out = document_causal_attention(q, k, v, lengths, scale)
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths, scale), rtol=1e-10, atol=1e-10)


def test_documents_do_not_see_each_other():
    lengths = [5, 6]
    q, k, v = random_qkv(lengths)
    out = document_causal_attention(q, k, v, lengths, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[:5] += 10.0  # perturb the first document only
    v2[:5] -= 3.0
    out2 = document_causal_attention(q, k2, v2, lengths, 0.3)
    assert torch.equal(out[5:], out2[5:])
    assert not torch.allclose(out[:5], out2[:5])


def _cp_worker(rank, world, lengths):
    import torch.distributed as dist

    torch.manual_seed(0)
    q, k, v = random_qkv(lengths, seed=1)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    scale = 0.25
    # full reference on every rank
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    ref = dense_reference(qf, kf, vf, lengths, scale)
    (ref * weights).sum().backward()
    # this rank's chunks
    idx = cp_token_indices(lengths, world, rank)
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    group = dist.new_group(list(range(world)))
    out = document_causal_attention(ql, kl, vl, lengths, scale, cp_group=group)
    (out * weights[idx]).sum().backward()
    errors = {
        "out": (out - ref[idx]).abs().max().item(),
        "dq": (ql.grad - qf.grad[idx]).abs().max().item(),
        "dk": (kl.grad - kf.grad[idx]).abs().max().item(),
        "dv": (vl.grad - vf.grad[idx]).abs().max().item(),
    }
    return errors


@pytest.mark.dist
@pytest.mark.parametrize("cp,lengths", [(2, [8, 4, 12]), (4, [16, 8])])
def test_context_parallel_matches_full_attention_forward_and_backward(cp, lengths):
    for errors in run_ranks(cp, fn=_cp_worker, args=(lengths,)):
        for name, err in errors.items():
            assert err < 1e-10, (name, err)

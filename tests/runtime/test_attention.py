"""Our CPU core attention against an independent dense reference: document-masked, causal,
GQA, and split over context-parallel ranks (forward and gradients)."""
import math

import pytest
import torch

from dcp_ext.runtime.stages.attention import KERNELS, document_causal_attention
from dcp_ext.runtime.schedule.context_parallel import cp_token_indices
from tests.support.helpers import run_ranks


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


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lengths", [[7], [3, 9, 1, 12], [16, 16]])
def test_packed_documents_match_dense_mask(lengths, kernel):
    q, k, v = random_qkv(lengths)
    scale = 1 / math.sqrt(8)
    out = document_causal_attention(q, k, v, lengths, scale, kernel=kernel)
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths, scale), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradients_match_dense_mask(kernel):
    lengths = [5, 17, 2, 9]
    q, k, v = random_qkv(lengths, seed=3)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = []
    for attend in (lambda *x: dense_reference(*x, lengths, 0.3),
                   lambda *x: document_causal_attention(*x, lengths, 0.3, kernel=kernel)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        (attend(*leaves) * weights).sum().backward()
        grads.append([x.grad for x in leaves])
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def saved_backward_nodes(out) -> set[str]:
    """Names of the autograd nodes behind `out` (a walk of its graph)."""
    seen, todo = {}, [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = type(node).__name__
        todo.extend(n for n, _ in node.next_functions)
    return set(seen.values())


def test_flash_runs_torchs_cpu_flash_kernel_and_math_keeps_probabilities():
    """The kernels differ in what they keep (the cost model's two sets of terms): flash runs
    torch's CPU flash kernel; math runs the softmax whose probabilities autograd keeps."""
    lengths = [6, 10]
    q, k, v = (x.requires_grad_() for x in random_qkv(lengths))
    flash = saved_backward_nodes(document_causal_attention(q, k, v, lengths, 0.3, kernel="flash"))
    math_ = saved_backward_nodes(document_causal_attention(q, k, v, lengths, 0.3, kernel="math"))
    assert any("FlashAttentionForCpu" in n for n in flash)
    assert not any("Softmax" in n for n in flash)
    assert any("Softmax" in n for n in math_)
    with pytest.raises(ValueError, match="unknown CPU attention kernel 'fast'"):
        document_causal_attention(q, k, v, lengths, 0.3, kernel="fast")


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


def _cp_worker(rank, world, lengths, kernel="math"):
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
    out = document_causal_attention(ql, kl, vl, lengths, scale, cp_group=group, kernel=kernel)
    (out * weights[idx]).sum().backward()
    errors = {
        "out": (out - ref[idx]).abs().max().item(),
        "dq": (ql.grad - qf.grad[idx]).abs().max().item(),
        "dk": (kl.grad - kf.grad[idx]).abs().max().item(),
        "dv": (vl.grad - vf.grad[idx]).abs().max().item(),
    }
    return errors


@pytest.mark.dist
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cp,lengths", [(2, [8, 4, 12]), (4, [16, 8])])
def test_context_parallel_matches_full_attention_forward_and_backward(cp, lengths, kernel):
    for errors in run_ranks(cp, fn=_cp_worker, args=(lengths, kernel)):
        for name, err in errors.items():
            assert err < 1e-10, (name, err)

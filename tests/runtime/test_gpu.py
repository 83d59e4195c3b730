"""GPU-only checks (skipped without CUDA; scripts/gpu_check.sh runs them on a GPU machine)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_document_attention_on_gpu_matches_cpu():
    from dcp_ext.runtime.stages.attention import document_causal_attention

    lengths = [100, 37, 300]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 8, 64, generator=g)
    k = torch.randn(sum(lengths), 4, 64, generator=g)
    v = torch.randn(sum(lengths), 4, 64, generator=g)
    cpu = document_causal_attention(q, k, v, lengths, 0.125)
    gpu = document_causal_attention(q.cuda(), k.cuda(), v.cuda(), lengths, 0.125).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-4)


def test_transformer_engine_thd_attention_matches_ours():
    te = pytest.importorskip("transformer_engine.pytorch")
    from dcp_ext.runtime.stages.attention import document_causal_attention

    lengths = [128, 64, 256]
    cu = torch.tensor([0, 128, 192, 448], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(448, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(448, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(448, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    attn = te.DotProductAttention(8, 64, qkv_format="thd", attn_mask_type="padding_causal")
    out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=256, max_seqlen_kv=256)
    ours = document_causal_attention(q.float(), k.float(), v.float(), lengths, 64**-0.5)
    torch.testing.assert_close(out.float().reshape(448, 8, 64), ours, rtol=3e-2, atol=3e-2)

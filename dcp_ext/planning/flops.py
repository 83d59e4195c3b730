"""Model FLOPs of GPT training on documents, counting causal attention per document.

Upstream Megatron counts attention on the packed sequence length (s_pack^2). With
document masking each document only attends to itself, so the honest count is
sum(s_doc^2), halved for causality. Used by the log line (TFLOP/s/GPU).
"""
from __future__ import annotations

from typing import Iterable


def forward_flops_per_token(
    hidden: int, ffn_hidden: int, num_heads: int, num_query_groups: int, kv_channels: int, swiglu: bool
) -> float:
    """Matmul FLOPs of one layer's forward for one token (attention scores excluded)."""
    q_width = num_heads * kv_channels
    qkv = 2 * hidden * (q_width + 2 * num_query_groups * kv_channels)
    proj = 2 * q_width * hidden
    mlp = 2 * hidden * ffn_hidden * (2 if swiglu else 1) + 2 * ffn_hidden * hidden
    return qkv + proj + mlp


def training_flops(
    doc_lengths: Iterable[int],
    *,
    num_layers: int,
    hidden: int,
    ffn_hidden: int,
    num_heads: int,
    num_query_groups: int,
    kv_channels: int,
    vocab_size: int,
    swiglu: bool,
) -> float:
    """Forward + backward (3x forward) FLOPs of the given documents; recomputation not counted."""
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    per_token = forward_flops_per_token(hidden, ffn_hidden, num_heads, num_query_groups, kv_channels, swiglu)
    # QK^T and AV: 2 * 2 * heads * d * s^2 for full attention, half of it causal.
    attention = 2 * num_heads * kv_channels * sum(s * s for s in lengths)
    logits = 2 * hidden * vocab_size * tokens
    return 3.0 * (num_layers * (per_token * tokens + attention) + logits)

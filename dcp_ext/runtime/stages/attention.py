"""Core attention for machines without transformer-engine: causal, document-masked, CP-aware.

megatron-core's local `DotProductAttention` refuses packed (THD) sequences and context
parallelism, and TE has no CPU build. This module fills that gap with one exact rule:
a query attends to the keys of its own document at positions <= its own.

Layouts handled (the same ones TE's attention takes from megatron-core):
- `sbhd`: query [s, b, heads, dim]; each batch row is one document.
- `thd` : query [t, heads, dim] with `PackedSeqParams` (cu_seqlens, padded or not).
With context parallelism each rank holds, for every document, the load-balanced chunks
of its padded length (`dcp_ext.runtime.schedule.context_parallel`), as megatron-core's CP RoPE assumes. Keys and values
are all-gathered over the CP group (gradients summed back), then attention runs per
document against the full key/value sequence with a global-position causal mask.

Two kernels (`--dcp-cpu-attention`): `math` hands SDPA 3-D tensors, which runs torch's math
path and keeps each document's softmax probabilities (memory quadratic in its length: the
CPU demo's stand-in for a GPU's long-context memory pressure); `flash` hands it 4-D tensors,
which runs torch's CPU flash kernel (the softmax statistics only: linear memory, and several
times faster on long documents; megatron-core's masked attention below runs it too).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from dcp_ext.runtime.schedule.context_parallel import cp_chunk_positions

KERNELS = ("math", "flash")


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU attention kernel {kernel!r} (choose from {', '.join(KERNELS)})")


class _GatherOverGroup(torch.autograd.Function):
    """all_gather in forward; in backward every rank gets the sum of the gathered grads' own slice.

    Written with all_reduce rather than reduce_scatter because gloo has no reduce_scatter.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def document_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded_lengths: list[int],
    softmax_scale: float,
    cp_group=None,
    dropout_p: float = 0.0,
    kernel: str = "math",
) -> torch.Tensor:
    """Attention over documents laid out one after another on dim 0.

    query [t_local, hq, d], key/value [t_local, hkv, d]; `padded_lengths` are the documents'
    GLOBAL (pre-CP-split) lengths, each a multiple of 2*cp when cp > 1. `kernel`: "math" or
    "flash" (see the module's docstring). Returns [t_local, hq, d].
    """
    _check_kernel(kernel)
    lead = (lambda x: x.unsqueeze(0)) if kernel == "flash" else (lambda x: x)  # 4-D: the flash kernel
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    local_lengths = [n // cp_size for n in padded_lengths]
    if sum(local_lengths) != query.shape[0]:
        raise ValueError(
            f"attention got {query.shape[0]} local tokens but documents sum to {sum(local_lengths)} (cp={cp_size})"
        )
    if cp_size > 1:
        all_keys = _GatherOverGroup.apply(key, cp_group)  # [cp, t_local, hkv, d]
        all_values = _GatherOverGroup.apply(value, cp_group)
    group_size = query.shape[1] // key.shape[1]

    outputs = []
    offset = 0
    for padded, local in zip(padded_lengths, local_lengths):
        q = query[offset : offset + local]
        if cp_size == 1:
            k = key[offset : offset + local]
            v = value[offset : offset + local]
            mask = None
        else:
            # Reassemble the full document: the gathered slices, in rank order, hold these positions.
            held = torch.cat([cp_chunk_positions(padded, cp_size, r, device=q.device) for r in range(cp_size)])
            order = torch.argsort(held)
            k = all_keys[:, offset : offset + local].reshape(padded, *key.shape[1:])[order]
            v = all_values[:, offset : offset + local].reshape(padded, *value.shape[1:])[order]
            q_pos = held[cp_rank * local : (cp_rank + 1) * local]
            k_pos = torch.arange(padded, device=q.device)
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # True = may attend
        # SDPA wants [heads, seq, dim]; it shares each key/value head over its query group itself
        out = F.scaled_dot_product_attention(
            lead(q.transpose(0, 1)),
            lead(k.transpose(0, 1)),
            lead(v.transpose(0, 1)),
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=mask is None,
            scale=softmax_scale,
            enable_gqa=group_size > 1,
        )
        outputs.append(out.reshape(out.shape[-3:]).transpose(0, 1))
        offset += local
    return torch.cat(outputs, dim=0)


class DocumentCausalAttention(MegatronModule):
    """Drop-in core attention (the local spec's `core_attention`) for CPU runs.

    Same constructor as megatron-core's `DotProductAttention` plus `kernel` ("math" or
    "flash", the layer spec's params); takes sbhd or THD inputs, any context-parallel size,
    and GQA.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        kernel: str = "math",
    ):
        super().__init__(config=config)
        _check_kernel(kernel)
        self.kernel = kernel
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by DocumentCausalAttention")
        cp_group = self.cp_group if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1 else None
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            lengths = (cu[1:] - cu[:-1]).tolist()
            out = document_causal_attention(query, key, value, lengths, self.softmax_scale, cp_group, dropout_p,
                                          self.kernel)
            return out.reshape(out.shape[0], -1)
        # sbhd: one document per batch row
        s, b = query.shape[0], query.shape[1]
        cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        if attention_mask is not None and cp == 1:
            return self._masked_sbhd(query, key, value, attention_mask, dropout_p)
        flat = lambda x: x.transpose(0, 1).reshape(b * s, x.shape[2], x.shape[3])
        out = document_causal_attention(
            flat(query), flat(key), flat(value), [s * cp] * b, self.softmax_scale, cp_group, dropout_p, self.kernel
        )
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _masked_sbhd(self, query, key, value, attention_mask, dropout_p):
        """Explicit Megatron mask [b, 1, s, s] with True = masked (e.g. --reset-attention-mask)."""
        group_size = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)
        k = key.repeat_interleave(group_size, dim=2).permute(1, 2, 0, 3)
        v = value.repeat_interleave(group_size, dim=2).permute(1, 2, 0, 3)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask.bool(), dropout_p=dropout_p, scale=self.softmax_scale
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

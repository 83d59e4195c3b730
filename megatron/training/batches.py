"""Micro-batches of the fixed-length (upstream Megatron) data path, ready for the model.

Samples from megatron-core's GPTDataset are `--seq-length` windows over concatenated
documents. Without `--reset-attention-mask` they run as [b, s] rows (full causal
attention per row). With it, each row is split into its documents at EOD tokens and the
micro-batch runs packed (THD, document-masked), which is both what the flag means and
what makes attention cost sum(s_doc^2). With context parallelism each document is padded
to a multiple of 2*cp and this rank keeps its load-balanced chunks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from dcp_ext.runtime.context_parallel import cp_token_indices, round_up


def document_lengths(tokens: torch.Tensor, eod: Optional[int]) -> list[int]:
    """Lengths of the documents in one row; a document ends with (and includes) its EOD."""
    n = tokens.numel()
    if eod is None:
        return [n]
    ends = (tokens[:-1] == eod).nonzero().flatten().tolist()
    bounds = [0] + [e + 1 for e in ends] + [n]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


def collate_fixed_length(samples: list[dict], args) -> dict:
    """Stack samples into this rank's micro-batch (its CP share), with the documents' lengths."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rows = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask")}
    rows["loss_mask"] = rows["loss_mask"].float()
    if "position_ids" in samples[0]:
        rows["position_ids"] = torch.stack([torch.as_tensor(s["position_ids"]) for s in samples])
    else:
        rows["position_ids"] = torch.arange(rows["tokens"].shape[1]).expand_as(rows["tokens"]).clone()
    if not args.reset_attention_mask:
        seq = rows["tokens"].shape[1]
        index = cp_token_indices([seq], cp_size, cp_rank)
        batch = {k: v[:, index] for k, v in rows.items()}
        batch["packed_seq_params"] = None
        batch["doc_lengths"] = [seq] * len(samples)
        return batch
    return pack_documents(rows, getattr(args, "eod_token", None), cp_size, cp_rank,
                          tp if args.sequence_parallel else 1)


def pack_documents(rows: dict, eod: Optional[int], cp_size: int, cp_rank: int, sp_multiple: int) -> dict:
    """THD micro-batch from [b, s] rows: documents padded to 2*cp, the pack to what SP needs."""
    from megatron.core.packed_seq_params import PackedSeqParams

    pieces = {k: [] for k in rows}
    lengths, padded = [], []
    multiple = 2 * cp_size if cp_size > 1 else 1
    for r in range(rows["tokens"].shape[0]):
        offset = 0
        for n in document_lengths(rows["tokens"][r], eod):
            p = round_up(n, multiple)
            for k, v in rows.items():
                seg = v[r, offset : offset + n]
                pad = torch.zeros(p - n, dtype=seg.dtype)
                if k == "position_ids":
                    pad = torch.arange(n, p, dtype=seg.dtype)
                pieces[k] += [seg, pad]
            lengths.append(n)
            padded.append(p)
            offset += n
    total = sum(padded)
    # Sequence parallel splits each CP rank's tokens over TP: the pack must divide by tp*cp.
    extra = 0
    step = math.lcm(multiple, sp_multiple * cp_size)
    if total % step:
        extra = round_up(total, step) - total
    if extra:
        for k in rows:
            pieces[k].append(torch.zeros(extra, dtype=rows[k].dtype))
        lengths.append(0)
        padded.append(extra)
    flat = {k: torch.cat(v).unsqueeze(0) for k, v in pieces.items()}
    index = cp_token_indices(padded, cp_size, cp_rank)
    batch = {k: v[:, index] for k, v in flat.items()}
    cu = torch.tensor([0] + list(_cumsum(lengths)), dtype=torch.int32)
    cu_padded = torch.tensor([0] + list(_cumsum(padded)), dtype=torch.int32)
    batch["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    batch["doc_lengths"] = [n for n in lengths if n]
    return batch


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total

"""Micro-batches of the fixed-length (upstream Megatron) data path, ready for the model.

Samples from megatron-core's GPTDataset are `--seq-length` windows over concatenated
documents. Without `--reset-attention-mask` they run as [b, s] rows (full causal
attention per row). With it, each row is split into its documents at EOD tokens and the
micro-batch runs packed (THD, document-masked), which is both what the flag means and
what makes attention cost sum(s_doc^2). With context parallelism each document is padded
to a multiple of 2*cp and this rank keeps its load-balanced chunks.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from dcp_ext.data.thd import FIELDS, pack
from dcp_ext.runtime.host_device import place_packed_seq_params, reads_lengths_on_host, to_device
from dcp_ext.runtime.schedule.context_parallel import cp_token_indices

TENSORS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator, model) -> dict:
    """The next micro-batch on the model's device, as upstream's `get_batch`: the tensors
    copied without a host wait (pinned, non-blocking on CUDA), the packed sequences' lengths
    kept on the host where the model's layers read them there (dcp_ext.runtime.host_device)."""
    given = next(data_iterator)
    batch = type(given)(given)  # a copy of the same kind (the --dcp runtime's names what it lacks)
    device = next(model.parameters()).device
    for key in TENSORS:
        batch[key] = to_device(batch[key], device)
    if batch.get("packed_seq_params") is not None:
        batch["packed_seq_params"] = place_packed_seq_params(batch["packed_seq_params"], device,
                                                             _lengths_on_host(model))
    return batch


_LENGTHS_ON_HOST = weakref.WeakKeyDictionary()  # model -> reads_lengths_on_host(model): its layers do not change


def _lengths_on_host(model) -> bool:
    if model not in _LENGTHS_ON_HOST:
        _LENGTHS_ON_HOST[model] = reads_lengths_on_host(model)
    return _LENGTHS_ON_HOST[model]


def document_lengths(tokens: torch.Tensor, eod: Optional[int]) -> list[int]:
    """Lengths of the documents in one row; a document ends with (and includes) its EOD."""
    n = tokens.numel()
    if eod is None:
        return [n]
    ends = (tokens[:-1] == eod).nonzero().flatten().tolist()
    bounds = [0] + [e + 1 for e in ends] + [n]
    return [b - a for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class Packing:
    """How the static path packs its fixed-length samples (`flags.records.packing_for`)."""

    reset_attention_mask: bool = False  # --reset-attention-mask: each document attends to itself (THD)
    eod: int | None = None  # the tokenizer's end-of-document id
    sequence_parallel: bool = False  # the pack divides by TP x CP


def collate_fixed_length(samples: list[dict], packing: "Packing") -> dict:
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
    if not packing.reset_attention_mask:
        seq = rows["tokens"].shape[1]
        index = cp_token_indices([seq], cp_size, cp_rank)
        batch = {k: v[:, index] for k, v in rows.items()}
        batch["packed_seq_params"] = None
        batch["doc_lengths"] = [seq] * len(samples)
        return batch
    return pack_documents(rows, packing.eod, cp_size, cp_rank, tp if packing.sequence_parallel else 1)


def pack_documents(rows: dict, eod: Optional[int], cp_size: int, cp_rank: int, sp_multiple: int) -> dict:
    """THD micro-batch from [b, s] rows: documents padded to 2*cp, the pack to what SP needs.

    The packer is the runtime's (`dcp_ext.data.thd.pack`); this path keeps its own padding
    rule: padding positions count on from the document, and the pack's extra padding is a
    segment of its own.
    """
    docs = []
    for r in range(rows["tokens"].shape[0]):
        offset = 0
        for n in document_lengths(rows["tokens"][r], eod):
            docs.append({k: rows[k][r, offset : offset + n].numpy() for k in FIELDS})
            offset += n
    # Sequence parallel splits each CP rank's tokens over TP: the pack must divide by tp*cp.
    thd = pack(docs, pad_each_to=2 * cp_size if cp_size > 1 else 1, pad_total_to=sp_multiple * cp_size,
               tail="segment", pad_positions="continue")
    index = cp_token_indices(torch.diff(thd.cu_seqlens_padded).tolist(), cp_size, cp_rank)
    batch = {k: getattr(thd, k)[index].unsqueeze(0) for k in FIELDS}
    batch["packed_seq_params"] = thd.packed_seq_params()
    batch["doc_lengths"] = [n for n in torch.diff(thd.cu_seqlens).tolist() if n]
    return batch

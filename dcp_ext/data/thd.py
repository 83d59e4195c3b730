"""THD micro-batches: documents concatenated, document-masked, padded only as TP/CP need.

Why: a micro-batch of the plan is several documents packed into one sequence; attention
is per document (cu_seqlens), positions restart per document, and padding goes only to
what the layout needs (never to --seq-length).

Conventions (fixed with the runtime):
- A document of L tokens occupies L positions; labels[j] = doc[j+1]; the last position of
  each document has loss_mask 0 (no next token); padding has loss_mask 0.
- `eod_mask_loss`: positions whose *input* token is EOD get loss_mask 0 (Megatron's
  --eod-mask-loss). SFT masks act on the label side: position j counts only if token j+1
  is a response token.
- `pad_each_to` (2*cp with context parallel) pads each document to a multiple;
  `pad_total_to` (tp with sequence parallel) pads the pack: the extra tokens extend the
  last document's padding, so every padded document length stays a multiple of
  `pad_each_to` and the total is a multiple of lcm(pad_each_to, pad_total_to).
- Padding positions: token and label `pad_id`, position ids counting from 0 again
  (0, 1, ...): no real token sees them, and they stay small (safe for learned
  absolute position embeddings).
- `cu_seqlens`: real lengths; `cu_seqlens_padded`: padded lengths (its last entry is the
  pack's length T); both int32 with a leading 0. `max_seqlen`: the longest *padded*
  document (what kernels size their work by).

`reset_position_ids`/`reset_attention_mask` are implied: every document restarts at
position 0 and attends only within itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ThdBatch:
    tokens: torch.Tensor            # [T] int64
    labels: torch.Tensor            # [T] int64
    loss_mask: torch.Tensor         # [T] float32
    position_ids: torch.Tensor      # [T] int64
    cu_seqlens: torch.Tensor        # [n+1] int32, real lengths
    cu_seqlens_padded: torch.Tensor  # [n+1] int32, padded lengths
    max_seqlen: int                 # longest padded document
    num_loss_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def seq_lengths(self) -> list[int]:
        return torch.diff(self.cu_seqlens).tolist()

    def packed_seq_params(self):
        """megatron.core PackedSeqParams (qkv_format 'thd') for this pack."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               cu_seqlens_q_padded=self.cu_seqlens_padded,
                               cu_seqlens_kv_padded=self.cu_seqlens_padded,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def to(self, device) -> "ThdBatch":
        return ThdBatch(self.tokens.to(device), self.labels.to(device), self.loss_mask.to(device),
                        self.position_ids.to(device), self.cu_seqlens.to(device),
                        self.cu_seqlens_padded.to(device), self.max_seqlen, self.num_loss_tokens)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_lengths(lengths, pad_each_to: int = 1, pad_total_to: int = 1) -> list[int]:
    """The padded length of each document in a pack (the same rule as build_micro_batch)."""
    if pad_each_to < 1 or pad_total_to < 1:
        raise ValueError("pad_each_to and pad_total_to must be >= 1")
    out = [_round_up(int(n), pad_each_to) for n in lengths]
    if out:
        q = pad_each_to * pad_total_to // math.gcd(pad_each_to, pad_total_to)
        out[-1] += _round_up(sum(out), q) - sum(out)
    return out


def build_micro_batch(docs, loss_masks=None, *, pad_each_to: int = 1, pad_total_to: int = 1,
                      eod_mask_loss: bool = False, eod: int | None = None, pad_id: int = 0) -> ThdBatch:
    if len(docs) == 0:
        raise ValueError("a micro-batch needs at least one document")
    if eod_mask_loss and eod is None:
        raise ValueError("eod_mask_loss needs the eod id")
    if loss_masks is not None and len(loss_masks) != len(docs):
        raise ValueError("one loss mask per document")
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    lens = [a.size for a in arrays]
    if min(lens) < 1:
        raise ValueError("documents must have at least one token")
    plens = padded_lengths(lens, pad_each_to, pad_total_to)
    total = sum(plens)
    tokens = np.full(total, pad_id, dtype=np.int64)
    labels = np.full(total, pad_id, dtype=np.int64)
    loss = np.zeros(total, dtype=np.float32)
    pos = np.empty(total, dtype=np.int64)
    at = 0
    for k, (a, n, p) in enumerate(zip(arrays, lens, plens)):
        tokens[at:at + n] = a
        labels[at:at + n - 1] = a[1:]
        m = np.ones(n, dtype=np.float32)
        m[n - 1] = 0.0
        if loss_masks is not None and loss_masks[k] is not None:
            resp = np.asarray(loss_masks[k]).reshape(-1)
            if resp.size != n:
                raise ValueError(f"loss mask {k} has {resp.size} entries for {n} tokens")
            m[: n - 1] *= resp[1:] != 0
        if eod_mask_loss:
            m[a == eod] = 0.0
        loss[at:at + n] = m
        pos[at:at + n] = np.arange(n)
        pos[at + n:at + p] = np.arange(p - n)
        at += p
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lens)
    cup = np.zeros(len(lens) + 1, dtype=np.int32)
    cup[1:] = np.cumsum(plens)
    return ThdBatch(tokens=torch.from_numpy(tokens), labels=torch.from_numpy(labels),
                    loss_mask=torch.from_numpy(loss), position_ids=torch.from_numpy(pos),
                    cu_seqlens=torch.from_numpy(cu), cu_seqlens_padded=torch.from_numpy(cup),
                    max_seqlen=int(max(plens)), num_loss_tokens=int(loss.sum()))


def materialize(dataset, sample_ids, **kwargs) -> ThdBatch:
    """Fetch the plan's sample ids from a document dataset and pack them (see build_micro_batch)."""
    docs = [dataset[int(i)] for i in sample_ids]
    masks = [dataset.loss_mask(int(i)) for i in sample_ids] if getattr(dataset, "has_loss_mask", False) else None
    return build_micro_batch(docs, masks, **kwargs)


def num_loss_tokens(dataset, sample_ids, eod_mask_loss: bool = False, eod: int | None = None) -> int:
    """Loss tokens of samples, as build_micro_batch counts them, without packing them.

    The global batch's loss divisor (DESIGN.md, "Loss"), known before the iteration runs.
    Plain data without --eod-mask-loss needs only the lengths (sum of L - 1, no .bin read).
    """
    ids = [int(i) for i in sample_ids]
    masked = getattr(dataset, "has_loss_mask", False)
    if not masked and not eod_mask_loss:
        return int(sum(int(n) - 1 for n in dataset.lengths_of(ids)))
    total = 0
    for i in ids:
        doc = np.asarray(dataset[i])
        m = np.ones(doc.size, dtype=bool)
        m[-1] = False
        if masked:
            m[:-1] &= np.asarray(dataset.loss_mask(i))[1:] != 0
        if eod_mask_loss:
            m &= doc != eod
        total += int(m.sum())
    return total

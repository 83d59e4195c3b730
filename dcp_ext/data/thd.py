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
  (`pack` is the one packer; the fixed-length path, megatron/training/loop/batches.py, calls it
  with its own padding rule: see `pack`.)
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

from dcp_ext.data.lengths import round_up


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


FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
TAILS = ("extend", "segment")
PAD_POSITIONS = ("restart", "continue")


def _layout(lengths, pad_each_to: int, pad_total_to: int, tail: str) -> tuple[list[int], list[int]]:
    """(real, padded) length of every piece of a pack: the documents, then with
    tail="segment" the pack's extra padding as one more piece of 0 real tokens."""
    if pad_each_to < 1 or pad_total_to < 1:
        raise ValueError("pad_each_to and pad_total_to must be >= 1")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, not {tail!r}")
    real = [int(n) for n in lengths]
    padded = [round_up(n, pad_each_to) for n in real]
    extra = round_up(sum(padded), math.lcm(pad_each_to, pad_total_to)) - sum(padded)
    if extra and tail == "segment":
        real.append(0)
        padded.append(extra)
    elif extra:
        padded[-1] += extra
    return real, padded


def padded_lengths(lengths, pad_each_to: int = 1, pad_total_to: int = 1) -> list[int]:
    """The padded length of each document in a pack (the same rule as build_micro_batch)."""
    return _layout(lengths, pad_each_to, pad_total_to, "extend")[1]


def pack(docs, pad_each_to: int = 1, pad_total_to: int = 1, *, pad_id: int = 0, tail: str = "extend",
         pad_positions: str = "restart") -> ThdBatch:
    """Lay documents out one after another, padded as the layout needs (the one THD packer).

    `docs`: one dict of FIELDS per document (1-D numpy arrays of the document's length,
    each field one dtype across documents). Padding: tokens and labels `pad_id`, loss
    mask 0. The padding rule is a parameter:
    - `tail`: where the pack's extra padding (for `pad_total_to`) goes: "extend" lengthens
      the last document's padding (the runtime's rule); "segment" makes it a piece of its
      own with 0 real tokens and every field its pad value, position ids 0 (the
      fixed-length path's rule).
    - `pad_positions`: position ids of a document's padding: "restart" counts 0, 1, ...;
      "continue" counts on from the document's length (n, n+1, ...).
    """
    if pad_positions not in PAD_POSITIONS:
        raise ValueError(f"pad_positions must be one of {PAD_POSITIONS}, not {pad_positions!r}")
    real, padded = _layout([d["tokens"].size for d in docs], pad_each_to, pad_total_to, tail)
    dtypes = {f: docs[0][f].dtype for f in FIELDS}
    fills = {"tokens": pad_id, "labels": pad_id, "loss_mask": 0, "position_ids": 0}
    pieces = {f: [] for f in FIELDS}
    for k, (n, p) in enumerate(zip(real, padded)):
        doc = docs[k] if k < len(docs) else None  # None: the tail segment
        for f in FIELDS:
            if doc is not None:
                pieces[f].append(doc[f])
            if f == "position_ids" and doc is not None:
                start = n if pad_positions == "continue" else 0
                pieces[f].append(np.arange(start, start + p - n, dtype=dtypes[f]))
            else:
                pieces[f].append(np.full(p - n, fills[f], dtype=dtypes[f]))
    flat = {f: torch.from_numpy(np.concatenate(pieces[f])) for f in FIELDS}
    cu = np.zeros(len(real) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(real)
    cup = np.zeros(len(padded) + 1, dtype=np.int32)
    cup[1:] = np.cumsum(padded)
    return ThdBatch(**flat, cu_seqlens=torch.from_numpy(cu), cu_seqlens_padded=torch.from_numpy(cup),
                    max_seqlen=int(max(padded)), num_loss_tokens=int(flat["loss_mask"].numpy().sum()))


def build_micro_batch(docs, loss_masks=None, *, pad_each_to: int = 1, pad_total_to: int = 1,
                      eod_mask_loss: bool = False, eod: int | None = None, pad_id: int = 0) -> ThdBatch:
    """Documents (token ids) to a THD micro-batch: labels, loss masks and positions per the
    conventions above, then `pack` with the runtime's padding rule."""
    if len(docs) == 0:
        raise ValueError("a micro-batch needs at least one document")
    if eod_mask_loss and eod is None:
        raise ValueError("eod_mask_loss needs the eod id")
    if loss_masks is not None and len(loss_masks) != len(docs):
        raise ValueError("one loss mask per document")
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    if min(a.size for a in arrays) < 1:
        raise ValueError("documents must have at least one token")
    fields = []
    for k, a in enumerate(arrays):
        n = a.size
        labels = np.full(n, pad_id, dtype=np.int64)
        labels[: n - 1] = a[1:]
        m = np.ones(n, dtype=np.float32)
        m[n - 1] = 0.0
        if loss_masks is not None and loss_masks[k] is not None:
            resp = np.asarray(loss_masks[k]).reshape(-1)
            if resp.size != n:
                raise ValueError(f"loss mask {k} has {resp.size} entries for {n} tokens")
            m[: n - 1] *= resp[1:] != 0
        if eod_mask_loss:
            m[a == eod] = 0.0
        fields.append({"tokens": a, "labels": labels, "loss_mask": m, "position_ids": np.arange(n, dtype=np.int64)})
    return pack(fields, pad_each_to, pad_total_to, pad_id=pad_id)


def materialize(dataset, sample_ids, **kwargs) -> ThdBatch:
    """Fetch the plan's sample ids from a document dataset and pack them (see build_micro_batch)."""
    docs = [dataset[int(i)] for i in sample_ids]
    masks = [dataset.loss_mask(int(i)) for i in sample_ids] if getattr(dataset, "has_loss_mask", False) else None
    return build_micro_batch(docs, masks, **kwargs)


def num_loss_tokens(dataset, sample_ids, eod_mask_loss: bool = False, eod: int | None = None) -> int:
    """Loss tokens of samples, as build_micro_batch counts them, without packing them.

    The global batch's loss divisor (docs/contracts.md, "Loss"), known before the iteration runs.
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

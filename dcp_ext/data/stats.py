"""Length statistics of a dataset: histogram and padding overhead (pure numpy, no torch).

Why: the length distribution decides which layouts pay off; the candidate-layout
generator reads the same histogram as `tools/dataset_stats.py` prints. The padding
figures compare Megatron's ways of fitting documents into `--seq-length` with ours
(documents packed as THD, each padded only to a multiple of lcm(2*cp, tp)).

All overheads are "extra token slots computed per real token" (0.25 = 25% more slots).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcp_ext.data.lengths import round_up


@dataclass
class LengthHistogram:
    edges: np.ndarray        # bucket i holds lengths in [edges[i], edges[i+1])
    counts: np.ndarray       # documents per bucket
    tokens: np.ndarray       # tokens per bucket
    num_documents: int
    num_tokens: int
    mean: float
    percentiles: dict        # {50: ..., 90: ..., 99: ..., 100: ...}

    def rows(self) -> list[tuple[int, int, int, float, float]]:
        """(lo, hi_exclusive, documents, % documents, % tokens) for non-empty buckets."""
        out = []
        for i in range(len(self.counts)):
            if self.counts[i]:
                out.append((int(self.edges[i]), int(self.edges[i + 1]), int(self.counts[i]),
                            100.0 * self.counts[i] / max(self.num_documents, 1),
                            100.0 * self.tokens[i] / max(self.num_tokens, 1)))
        return out

    def to_json(self) -> dict:
        return {"edges": self.edges.tolist(), "counts": self.counts.tolist(), "tokens": self.tokens.tolist(),
                "num_documents": self.num_documents, "num_tokens": self.num_tokens, "mean": self.mean,
                "percentiles": {str(k): v for k, v in self.percentiles.items()}}


def length_histogram(lengths, edges=None) -> LengthHistogram:
    """Power-of-two buckets [1,2), [2,4), ... by default; `edges` to choose your own."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if edges is None:
        top = int(lengths.max()) if lengths.size else 1
        edges = 2 ** np.arange(0, max(1, math.ceil(math.log2(top + 1))) + 1)
    edges = np.asarray(edges, dtype=np.int64)
    which = np.clip(np.searchsorted(edges, lengths, side="right") - 1, 0, len(edges) - 2)
    counts = np.bincount(which, minlength=len(edges) - 1)[: len(edges) - 1]
    tokens = np.bincount(which, weights=lengths, minlength=len(edges) - 1)[: len(edges) - 1].astype(np.int64)
    pct = {p: (float(np.percentile(lengths, p)) if lengths.size else 0.0) for p in (50, 90, 99, 100)}
    return LengthHistogram(edges, counts, tokens, int(lengths.size), int(lengths.sum()),
                           float(lengths.mean()) if lengths.size else 0.0, pct)


def _count_bins(lengths: np.ndarray, capacity: int) -> int:
    """Bins of `capacity` needed by best-fit decreasing (Megatron-style packed sequences)."""
    import bisect

    free: list[int] = []
    bins = 0
    for n in sorted((int(x) for x in lengths), reverse=True):
        k = bisect.bisect_left(free, n)
        if k < len(free):
            rest = free.pop(k) - n
        else:
            bins += 1
            rest = capacity - n
        if rest > 0:
            bisect.insort(free, rest)
    return bins


def padding_overhead(lengths, seq_length: int, cp: int = 1, tp: int = 1, sequence_parallel: bool | None = None
                     ) -> dict:
    """Compute slots per real token for Megatron's fixed-length ways vs THD per document.

    Lengths are first truncated to seq_length (what every strategy trains). Returns:
    - pad_to_seq_length: each document its own sample padded to seq_length (SFT style).
    - packed_best_fit: documents packed into seq_length bins (best-fit decreasing), the
      rest padded (Megatron's packed-sequence SFT).
    - concat_attention: Megatron pretraining concatenates whole documents (no padding,
      no truncation) into seq_length windows and attends across documents: its extra
      causal attention work over the same windows with a per-document mask.
    - thd_ours: THD, each document padded to a multiple of lcm(2*cp, tp) (tp only with
      sequence parallel, the default when tp > 1).
    """
    full = np.asarray(lengths, dtype=np.int64)
    full = full[full > 0]
    L = np.minimum(full, seq_length)
    real = int(L.sum())
    if real == 0:
        raise ValueError("no tokens")
    sp = (tp > 1) if sequence_parallel is None else sequence_parallel
    a = 2 * cp if cp > 1 else 1
    b = tp if sp else 1
    q = a * b // math.gcd(a, b)
    thd_slots = int(round_up(L, q).sum())
    bins = _count_bins(L, seq_length)
    # windows over the concatenation; pieces = documents cut at window edges
    stream = int(full.sum())
    cuts = np.union1d(np.cumsum(full), np.arange(seq_length, stream, seq_length, dtype=np.int64))
    pieces = np.diff(np.concatenate([[0], cuts])).astype(np.float64)
    concat_attn = (stream // seq_length) * seq_length * (seq_length + 1) / 2 + \
        (stream % seq_length) * (stream % seq_length + 1) / 2
    doc_attn = float((pieces * (pieces + 1) / 2).sum())
    return {
        "documents": int(L.size), "tokens": real, "seq_length": int(seq_length), "cp": cp, "tp": tp,
        "pad_multiple": q,
        "pad_to_seq_length": (L.size * seq_length - real) / real,
        "packed_best_fit": (bins * seq_length - real) / real, "packed_bins": bins,
        "concat_attention": concat_attn / doc_attn - 1.0,
        "thd_ours": (thd_slots - real) / real,
    }

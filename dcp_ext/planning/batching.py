"""The global batch rule (docs/contracts.md): every strategy trains the same samples per iteration.

Lengths are truncated to max_seq_len; samples are taken in dataset order until one more
would exceed global_batch_tokens (at least one sample per batch); that sample opens the
next batch. Planners never choose batch membership, only placement.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


def iter_global_batches(
    lengths: Sequence[int], global_batch_tokens: int, max_seq_len: int, start: int = 0
) -> Iterator[list[int]]:
    """Yield the sample ids (indices into `lengths`) of each global batch, from `start`."""
    if global_batch_tokens < 1 or max_seq_len < 1:
        raise ValueError("global_batch_tokens and max_seq_len must be >= 1")
    i, n = start, len(lengths)
    while i < n:
        batch, tokens = [i], min(int(lengths[i]), max_seq_len)
        i += 1
        while i < n:
            s = min(int(lengths[i]), max_seq_len)
            if tokens + s > global_batch_tokens:
                break
            batch.append(i)
            tokens += s
            i += 1
        yield batch


def global_batches(
    lengths: Sequence[int], global_batch_tokens: int, max_seq_len: int, count: int | None = None, start: int = 0
) -> list[list[int]]:
    out = []
    for b in iter_global_batches(lengths, global_batch_tokens, max_seq_len, start):
        if count is not None and len(out) >= count:
            break
        out.append(b)
    return out


def sample_batches(length_sample: Sequence[int], global_batch_tokens: int, max_seq_len: int, count: int, seed: int) -> list[np.ndarray]:
    """Global batches drawn from the dataset's length histogram: the sample shuffled with
    `seed`, cut by the global batch rule; `count` of them, evenly spaced. These are not the
    batches the run will see, only batches like them."""
    lens = np.minimum(np.asarray(length_sample, dtype=np.int64), max_seq_len)
    if len(lens) == 0:
        raise ValueError("empty length sample")
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    rounds = 0
    while len(out) < count and rounds < 8:
        perm = lens[rng.permutation(len(lens))]
        batches = [perm[b] for b in iter_global_batches(perm, global_batch_tokens, max_seq_len)]
        if batches and batches[-1].sum() < 0.5 * global_batch_tokens and len(batches) > 1:
            batches = batches[:-1]  # a short tail batch is not typical
        out.extend(batches)
        rounds += 1
    if len(out) > count:
        pick = np.linspace(0, len(out) - 1, count).round().astype(int)
        out = [out[i] for i in pick]
    return out


def extreme_batches(length_sample: Sequence[int], global_batch_tokens: int, max_seq_len: int, seed: int) -> list[np.ndarray]:
    """Batches of the histogram's short half only, its long tail only, and a typical batch
    with its few longest documents: rarer batches the candidate pool should also serve."""
    lens = np.minimum(np.asarray(length_sample, dtype=np.int64), max_seq_len)
    rng = np.random.default_rng(seed + 1)
    out = []
    for lo_q, hi_q in ((0.0, 0.5), (0.9, 1.0)):
        lo, hi = np.quantile(lens, lo_q), np.quantile(lens, hi_q)
        pool = lens[(lens >= lo) & (lens <= hi)]
        if len(pool) == 0:
            continue
        pick = pool[rng.integers(0, len(pool), size=4 * len(lens) + 16)]
        cs = np.cumsum(pick)
        k = max(1, int(np.searchsorted(cs, global_batch_tokens, side="right")))
        out.append(pick[:k])
    return out

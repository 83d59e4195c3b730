"""The global batch rule (docs/contracts.md): every strategy trains the same samples per iteration.

Lengths are truncated to max_seq_len; samples are taken in dataset order until one more
would exceed global_batch_tokens (at least one sample per batch); that sample opens the
next batch. Planners never choose batch membership, only placement.
"""
from __future__ import annotations

from typing import Iterator, Sequence


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

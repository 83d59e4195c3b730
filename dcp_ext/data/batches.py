"""Global batches by tokens, drawn ahead of time, resumable from consumed samples.

Why: the planner plans iteration i+1 while i trains, so it needs the next batches'
sample ids and lengths before they are trained; a checkpoint stores one integer
(consumed samples) and a resumed run must draw exactly the batches an uninterrupted run
would. The batch rule itself is docs/contracts.md's, implemented once in `dcp_ext.planning.batching`.

    stream = GlobalBatchStream(train, global_batch_tokens=65536, max_seq_len=4096,
                               consumed_samples=ckpt_consumed)
    upcoming = stream.peek(2)          # [GlobalBatch(sample_ids, lengths), ...], not consumed
    ids, lengths = stream.next()       # consumes one batch
    stream.consumed_samples            # -> store in the checkpoint

Any dataset with `sample_lengths(start, stop)` works (DocumentDataset,
BlendedDocumentDataset, or a plain array via `ArrayLengths`). Training streams are
unbounded (sample ids run past one epoch); `limit` ends a stream (e.g. an evaluation
pass over one epoch) and the last batch stops at the limit. Pure numpy: no torch.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from dcp_ext.planning.batching import global_batches


class GlobalBatch(NamedTuple):
    sample_ids: list[int]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))


class ArrayLengths:
    """A fixed list of lengths seen as a dataset (tests, simulations)."""

    def __init__(self, lengths):
        self._l = np.asarray(lengths, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._l)

    def sample_lengths(self, start: int, stop: int) -> np.ndarray:
        return self._l[start:stop]


class GlobalBatchStream:
    """`global_batch_tokens`: every batch's token budget, or a function of the batch's index
    (`first_batch` for the first batch this stream draws): a batch-size schedule's budgets."""

    def __init__(self, dataset, global_batch_tokens, max_seq_len: int, consumed_samples: int = 0,
                 limit: int | None = None, first_batch: int = 0):
        self._budget = global_batch_tokens if callable(global_batch_tokens) else None
        if self._budget is not None:
            global_batch_tokens = 1  # asked of the function as each batch is drawn
        if global_batch_tokens < 1 or max_seq_len < 1:
            raise ValueError("global_batch_tokens and max_seq_len must be >= 1")
        if consumed_samples < 0:
            raise ValueError("consumed_samples must be >= 0")
        if isinstance(dataset, ArrayLengths) and limit is None:
            limit = len(dataset)
        self.dataset = dataset
        self.global_batch_tokens = int(global_batch_tokens)  # the next batch's budget
        self._drawn = first_batch  # index of the next batch to draw
        self.max_seq_len = int(max_seq_len)
        self.limit = limit
        self._consumed = int(consumed_samples)
        self._ahead: deque[GlobalBatch] = deque()
        self._cursor = self._consumed  # first sample id not yet in a drawn batch
        self._window = 256

    @property
    def consumed_samples(self) -> int:
        return self._consumed

    def _draw(self) -> GlobalBatch | None:
        if self._budget is not None:
            self.global_batch_tokens = int(self._budget(self._drawn))
            if self.global_batch_tokens < 1:
                raise ValueError(f"batch {self._drawn}: global_batch_tokens must be >= 1")
        start = self._cursor
        if self.limit is not None and start >= self.limit:
            return None
        while True:
            stop = start + self._window
            if self.limit is not None:
                stop = min(stop, self.limit)
            lengths = np.minimum(np.asarray(self.dataset.sample_lengths(start, stop)), self.max_seq_len)
            if np.any(lengths < 1):
                raise ValueError(f"sample with no tokens between ids {start} and {stop}")
            batch = global_batches(lengths, self.global_batch_tokens, self.max_seq_len, count=1)[0]
            ends_at_window = len(batch) == len(lengths)
            if not ends_at_window or (self.limit is not None and stop == self.limit):
                break
            self._window *= 2  # the batch may go on past the window: look further
        self._window = max(256, 2 * len(batch))
        self._cursor = start + len(batch)
        self._drawn += 1
        return GlobalBatch([start + i for i in batch], [int(lengths[i]) for i in batch])

    def peek(self, k: int = 1) -> list[GlobalBatch]:
        """The next k batches (fewer at the end of a limited stream), without consuming them."""
        while len(self._ahead) < k:
            b = self._draw()
            if b is None:
                break
            self._ahead.append(b)
        return list(self._ahead)[:k]

    def next(self) -> GlobalBatch:
        if not self.peek(1):
            raise StopIteration
        b = self._ahead.popleft()
        self._consumed = b.sample_ids[-1] + 1
        return b

    def __iter__(self):
        return self

    def __next__(self) -> GlobalBatch:
        return self.next()

    def state_dict(self) -> dict:
        return {"consumed_samples": self._consumed}

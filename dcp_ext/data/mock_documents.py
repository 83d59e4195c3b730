"""`--mock-data` under `--dcp`: synthetic documents whose lengths vary like real ones.

Why it exists: upstream Megatron's mock data (megatron-core's MockGPTDataset) draws
lengths uniformly and then concatenates them into `--seq-length` windows, which is what
the static path trains on. The adaptive runtime plans from the length of every document,
so its mock data must have a realistic spread, or a `--mock-data` run would show nothing
of what the planner does.

Lengths: drawn from the distribution of `data/lengths/code_python_cl100k.txt` (14,586
Python source files counted with cl100k_base; provenance in `data/lengths/README.md`),
kept here as its quantile function (58 percentiles, interpolated log-linearly between
them: `CODE_QUANTILES`) so nothing is read at run time. The lengths are scaled by
min(1, max_seq_len / p90) so that the distribution keeps its shape at any `--seq-length`:
the p90 document (9,108 tokens) meets the truncation length, about a tenth of the
documents are truncated, the median is about a seventh of the maximum. Every document has
at least two tokens (one to predict).

Tokens: random in the vocabulary, from a Zipf law (p(k) ~ 1/(k+1) over a random
permutation of the ids; natural text is Zipfian, and a uniform law would leave a model
nothing to learn), the last token of each document the EOD. Deterministic per seed
and split: document i of a split is the same on every rank and in every run.
"""
from __future__ import annotations

import numpy as np

# (percentile, tokens) of code_python_cl100k.txt (numpy.percentile, linear).
CODE_QUANTILES: tuple[tuple[float, int], ...] = tuple(zip(
    (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54,
     56, 58, 60, 62, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99,
     99.5, 99.9, 100),
    (5, 19, 45, 75, 109, 138, 176, 216, 252, 290, 342, 391, 446, 499, 557, 603, 616, 641, 702, 774, 854, 930,
     1014, 1105, 1206, 1303, 1419, 1553, 1688, 1820, 1999, 2165, 2348, 2549, 2800, 3065, 3327, 3685, 4075, 4491,
     4967, 5400, 6072, 6853, 7774, 9108, 9994, 10789, 11914, 13254, 14684, 16711, 19302, 23849, 32748, 42747,
     71463, 167228),
))
SOURCE = "data/lengths/code_python_cl100k.txt"
P90 = 9108
MOCK_DOCUMENTS = 1 << 16  # documents per split; sample ids past it wrap (a new epoch)
SPLITS = ("train", "valid", "test")
ZIPF_EXPONENT = 1.0


def length_scale(max_seq_len: int) -> float:
    return min(1.0, max_seq_len / P90)


def mock_lengths(n: int, max_seq_len: int, seed: int, salt: int = 0) -> np.ndarray:
    """n document lengths (int64) from the code distribution, scaled to `max_seq_len` and
    truncated to it; at least 2 tokens each (1 when max_seq_len is 1)."""
    pct = np.array([p for p, _ in CODE_QUANTILES], dtype=np.float64) / 100.0
    logs = np.log(np.array([v for _, v in CODE_QUANTILES], dtype=np.float64))
    u = np.random.default_rng([int(seed), 7919, int(salt)]).random(n)
    raw = np.exp(np.interp(u, pct, logs))
    out = np.rint(raw * length_scale(max_seq_len)).astype(np.int64)
    return np.clip(out, min(2, max_seq_len), max_seq_len)


class MockDocumentDataset:
    """One split of mock documents, with the interface of `documents.DocumentDataset`."""

    has_loss_mask = False

    def __init__(self, max_seq_len: int, vocab_size: int, eod: int | None, seed: int, name: str = "train",
                 num_documents: int = MOCK_DOCUMENTS):
        if max_seq_len < 1 or vocab_size < 2:
            raise ValueError("mock documents need max_seq_len >= 1 and a vocabulary of at least 2 ids")
        self.name, self.seed, self.max_seq_len = name, int(seed), int(max_seq_len)
        self.vocab_size = int(vocab_size)
        self.eod = None if eod is None or not 0 <= int(eod) < vocab_size else int(eod)
        self._salt = SPLITS.index(name) if name in SPLITS else len(SPLITS)
        self._len = mock_lengths(num_documents, self.max_seq_len, self.seed, self._salt)
        ids = np.arange(self.vocab_size)
        if self.eod is not None:
            ids = ids[ids != self.eod]
        self._ids = np.random.default_rng([self.seed, 104729, self._salt]).permutation(ids)
        w = 1.0 / np.arange(1, len(self._ids) + 1, dtype=np.float64) ** ZIPF_EXPONENT
        self._cdf = np.cumsum(w / w.sum())

    def __len__(self) -> int:
        return len(self._len)

    def lengths_of(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise IndexError("sample ids must be >= 0")
        return self._len[ids % len(self._len)]

    def sample_lengths(self, start: int, stop: int) -> np.ndarray:
        return self.lengths_of(np.arange(start, stop, dtype=np.int64))

    @property
    def lengths(self) -> np.ndarray:
        return self._len.copy()

    def __getitem__(self, i: int) -> np.ndarray:
        n = int(self.lengths_of([i])[0])
        rng = np.random.default_rng([self.seed, self._salt, int(i)])
        picks = np.searchsorted(self._cdf, rng.random(n), side="right").clip(max=len(self._ids) - 1)
        tokens = self._ids[picks].astype(np.int64)
        if self.eod is not None:
            tokens[-1] = self.eod
        return tokens

    def loss_mask(self, i: int) -> None:
        return None

    def source(self, i: int) -> tuple[str, int, int]:
        return f"mock-data ({self.name})", int(i) % len(self._len), 0

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def build_mock_document_datasets(max_seq_len: int, vocab_size: int, eod: int | None, seed: int,
                                 eval_iters: int = 0):
    """-> (train, valid, test) mock document datasets; valid and test only when evaluating."""
    train = MockDocumentDataset(max_seq_len, vocab_size, eod, seed, "train")
    if eval_iters <= 0:
        return train, None, None
    return (train, MockDocumentDataset(max_seq_len, vocab_size, eod, seed, "valid"),
            MockDocumentDataset(max_seq_len, vocab_size, eod, seed, "test"))

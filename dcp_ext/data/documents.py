"""Documents as samples: one `.bin/.idx` sequence (or a chunk of it) per sample.

Why: upstream Megatron's GPTDataset concatenates documents into fixed `--seq-length`
samples; the adaptive engine needs each document as its own sample with its length known
before the batch forms, so the planner can look ahead.

    train, valid, test = build_document_datasets(["0.7", "a_text_document", "0.3", "b_text_document"],
                                                 split="969,30,1", seed=1234, max_seq_len=4096)
    train.lengths            # np.ndarray, tokens per sample of epoch 0 (from the .idx only)
    train.sample_lengths(a, b)   # lengths of sample ids a..b-1 (any epoch)
    train[i]                 # np.ndarray of token ids (the .bin is read here, and only here)
    train.loss_mask(i)       # np.ndarray uint8 per token for SFT data, else None

Semantics, in Megatron's terms:
- `data_path`: Megatron's blend syntax (`[prefix]`, `[p1, p2, ...]` weighted by size, or
  `[w1, p1, w2, p2, ...]`); each prefix is split by `--split` into contiguous document
  ranges (as megatron.core's builder does), then shuffled; blends interleave the
  components by weight with megatron.core's own blending kernel (`build_blending_indices`).
- Sample ids are global and unbounded: id i of a dataset with N samples per epoch is
  sample i % N of epoch i // N; every epoch has its own seeded permutation. So consumed
  samples is one integer and resuming at k continues exactly.
- Lengths are truncated at `max_seq_len` (the document's first tokens are kept) or, with
  `split_long_documents`, a long document becomes chunks of at most `max_seq_len` that
  overlap by one token, so every next-token pair is trained exactly once.
- Empty documents are skipped. An empty dataset, a missing or corrupt file, or (with
  `vocab_size`) a token id beyond the vocabulary raise DataError naming the file.
"""
from __future__ import annotations

import math
import re
import warnings
from functools import lru_cache

import numpy as np

from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import IndexedDocuments, check_same_data_on_every_rank

SPLIT_NAMES = ("train", "valid", "test")


# ---- Megatron's data-path and split conventions ------------------------------------------------

def parse_blend(data_path) -> tuple[list[str], list[float] | None]:
    """Megatron blend syntax -> (prefixes, weights or None)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = [str(x) for x in (data_path or [])]
    if not items:
        raise DataError("--data-path is empty")
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            # nan <= 0 is False: test what a weight must be, not what it must not be
            if not all(math.isfinite(w) and w > 0 for w in weights):
                raise DataError(f"--data-path weights must be finite numbers > 0: {' '.join(items[0::2])}")
            return [p.strip() for p in items[1::2]], weights
    for p in items:
        if _is_number(p):
            raise DataError(f"--data-path mixes weights and prefixes oddly: {' '.join(items)}")
    return [p.strip() for p in items], None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def split_bookends(split: str) -> list[tuple[float, float] | None]:
    """'969,30,1' -> [(0, .969), (.969, .999), (.999, 1.0)] (None for an empty split)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split or "")]
    if not parts or len(parts) > 3 or sum(parts) <= 0 or "-" in (split or ""):
        raise DataError(f"bad --split {split!r}: expected up to three non-negative weights like 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    out, acc = [], 0.0
    for w in parts:
        lo, hi = acc, acc + w / total
        out.append((lo, hi) if w > 0 else None)
        acc = hi
    return out


# ---- one prefix, one split ------------------------------------------------------------------

def _chunk_units(doc_ids: np.ndarray, lengths: np.ndarray, max_seq_len: int, split_long: bool):
    """(doc id, token offset, length) per sample, before shuffling."""
    keep = lengths > 0
    doc_ids, lengths = doc_ids[keep].astype(np.int64), lengths[keep].astype(np.int64)
    if not split_long:
        return doc_ids, np.zeros_like(doc_ids), np.minimum(lengths, max_seq_len)
    stride = max(max_seq_len - 1, 1)  # chunks overlap by one token
    counts = np.where(lengths > max_seq_len, -(-(lengths - 1) // stride), 1)
    starts = np.cumsum(counts) - counts
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    offsets = k * stride
    rep_len = np.repeat(lengths, counts)
    return np.repeat(doc_ids, counts), offsets, np.minimum(max_seq_len, rep_len - offsets)


class DocumentDataset:
    """The samples of one split of one `.bin/.idx` prefix, shuffled per epoch."""

    def __init__(self, docs: IndexedDocuments, doc_range: tuple[int, int], max_seq_len: int, seed: int,
                 split_long_documents: bool = False, name: str = "train"):
        if max_seq_len < 1:
            raise DataError("max_seq_len must be >= 1")
        self.docs, self.name, self.seed, self.max_seq_len = docs, name, int(seed), int(max_seq_len)
        lo, hi = doc_range
        ids = np.arange(lo, hi, dtype=np.int64)
        self._doc, self._off, self._len = _chunk_units(ids, np.asarray(docs.lengths[lo:hi]), max_seq_len,
                                                       split_long_documents)
        self._len = self._len.astype(np.int64)
        self.has_loss_mask = docs.has_loss_mask
        self.vocab_size: int | None = None  # set by build_document_datasets: every read is checked against it
        self._perm_cache: dict[int, np.ndarray] = {}
        original = np.asarray(docs.lengths[lo:hi], dtype=np.int64)
        # (documents cut, tokens dropped, tokens in the split) by the truncation at max_seq_len
        self.truncation = (0, 0, int(original.sum())) if split_long_documents else (
            int(np.count_nonzero(original > max_seq_len)), int(np.maximum(original - max_seq_len, 0).sum()),
            int(original.sum()))

    def __len__(self) -> int:
        """Samples per epoch."""
        return len(self._len)

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perm_cache.get(epoch)
        if p is None:
            split_salt = SPLIT_NAMES.index(self.name) if self.name in SPLIT_NAMES else 3
            p = np.random.default_rng([self.seed, split_salt, epoch]).permutation(len(self._len))
            if len(self._perm_cache) >= 4:
                self._perm_cache.pop(next(iter(self._perm_cache)))
            self._perm_cache[epoch] = p
        return p

    def _units(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise IndexError("sample ids must be >= 0")
        n = len(self._len)
        epochs, pos = np.divmod(ids, n)
        out = np.empty_like(ids)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def sample_lengths(self, start: int, stop: int) -> np.ndarray:
        """Token counts of sample ids start..stop-1 (after truncation/splitting)."""
        return self._len[self._units(np.arange(start, stop, dtype=np.int64))]

    def lengths_of(self, ids) -> np.ndarray:
        return self._len[self._units(np.asarray(ids))]

    @property
    def lengths(self) -> np.ndarray:
        return self.sample_lengths(0, len(self))

    def __getitem__(self, i: int) -> np.ndarray:
        u = int(self._units(np.array([i]))[0])
        tokens = np.asarray(self.docs.tokens(self._doc[u], self._off[u], self._len[u]), dtype=np.int64)
        if self.vocab_size is not None:
            self.docs.check_token_ids(tokens, self.vocab_size, self._doc[u])
        return tokens

    def loss_mask(self, i: int) -> np.ndarray | None:
        if not self.has_loss_mask:
            return None
        u = int(self._units(np.array([i]))[0])
        return np.asarray(self.docs.loss_mask(self._doc[u], self._off[u], self._len[u]), dtype=np.uint8)

    def source(self, i: int) -> tuple[str, int, int]:
        """(prefix, document index in the .idx, token offset) of sample id i."""
        u = int(self._units(np.array([i]))[0])
        return self.docs.prefix, int(self._doc[u]), int(self._off[u])

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


# ---- blends ---------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _blending_kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.helpers_cpp import build_blending_indices
    return build_blending_indices


def truncation_note(ds, max_seq_len: int) -> str | None:
    """The line that says what --dcp-max-seq-len cuts from a split, or None when it cuts nothing.
    Documents are truncated to their first max_seq_len tokens (unless split): the rest never
    trains, which a run should say once, at start, rather than train on far fewer tokens."""
    parts = [d for d in getattr(ds, "datasets", [ds]) if hasattr(d, "truncation")]
    cut = sum(d.truncation[0] for d in parts)
    dropped = sum(d.truncation[1] for d in parts)
    total = sum(d.truncation[2] for d in parts)
    if not dropped:
        return None
    return (f"--dcp-max-seq-len {max_seq_len} cuts {cut:,} of the {ds.name} split's {len(ds):,} documents to their "
            f"first {max_seq_len} tokens: {dropped:,} of {total:,} tokens ({100 * dropped / max(total, 1):.1f}%) never "
            "train; --dcp-split-long-documents trains them as further samples, or raise --dcp-max-seq-len")


class BlendedDocumentDataset:
    """Components interleaved by weight (megatron.core's greedy blending, unbounded ids)."""

    def __init__(self, datasets: list[DocumentDataset], weights: list[float]):
        if len(datasets) >= 32767:
            raise DataError("too many datasets in one blend")
        self.datasets = datasets
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.name = datasets[0].name
        self.has_loss_mask = all(d.has_loss_mask for d in datasets)
        self._ds_index = np.zeros(0, dtype=np.int16)
        self._ds_sample = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def _ensure(self, size: int) -> None:
        # The greedy rule depends only on the position, so a longer index extends a shorter one.
        if size <= len(self._ds_index):
            return
        n = max(1024, 1 << int(np.ceil(np.log2(size))))
        ds_index = np.zeros(n, dtype=np.int16)
        ds_sample = np.zeros(n, dtype=np.int64)
        _blending_kernel()(ds_index, ds_sample, self.weights, len(self.datasets), n, False)
        self._ds_index, self._ds_sample = ds_index, ds_sample

    def _route(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and ids.min() < 0:
            raise IndexError("sample ids must be >= 0")
        self._ensure(int(ids.max()) + 1 if ids.size else 0)
        return self._ds_index[ids], self._ds_sample[ids]

    def lengths_of(self, ids) -> np.ndarray:
        which, local = self._route(ids)
        out = np.empty(len(which), dtype=np.int64)
        for k, d in enumerate(self.datasets):
            sel = which == k
            if sel.any():
                out[sel] = d.lengths_of(local[sel])
        return out

    def sample_lengths(self, start: int, stop: int) -> np.ndarray:
        return self.lengths_of(np.arange(start, stop, dtype=np.int64))

    @property
    def lengths(self) -> np.ndarray:
        return self.sample_lengths(0, len(self))

    def __getitem__(self, i: int) -> np.ndarray:
        which, local = self._route(np.array([i]))
        return self.datasets[int(which[0])][int(local[0])]

    def loss_mask(self, i: int) -> np.ndarray | None:
        which, local = self._route(np.array([i]))
        return self.datasets[int(which[0])].loss_mask(int(local[0]))

    def source(self, i: int) -> tuple[str, int, int]:
        which, local = self._route(np.array([i]))
        return self.datasets[int(which[0])].source(int(local[0]))

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


# ---- the builder ----------------------------------------------------------------------------

def no_trainable_tokens_message(prefix: str, split_name: str, split: str) -> str:
    return (f"{prefix}: the {split_name} split (--split {split}) has no trainable token: its SFT loss mask "
            f"({prefix}_loss_mask) marks none, so it would train at loss 0; check --prompt-key/--response-key "
            "(or the chat roles) when preprocessing")


def split_range(bookend: tuple[float, float], n: int) -> tuple[int, int]:
    """The documents [lo, hi) of one split of `n`, rounded as megatron-core rounds them."""
    return int(round(bookend[0] * n)), int(round(bookend[1] * n))


def empty_split_message(name: str, where: str, docs_in_split: int, total: int, split: str,
                        eval_iters: int | None) -> str:
    """The line for a split that --split gives a share but no document (or no token):
    megatron-core would wait for ever on it; say it before training."""
    what = "0 documents" if docs_in_split == 0 else f"{docs_in_split} document(s) but no token"
    asked = f"--eval-iters {eval_iters} evaluates it" if eval_iters is not None else "evaluation reads it"
    return (f"the {name} split of {where} gets {what} of its {total} with --split {split}, and {asked}: use more "
            "data, a --split that gives it documents (e.g. 98,2,0: no test split), or --eval-iters 0")


def _open_checked(prefix: str, vocab_size, tokenizer) -> "IndexedDocuments":
    docs = IndexedDocuments(prefix)
    if len(docs) == 0 or int(np.count_nonzero(docs.lengths)) == 0:
        raise DataError(f"dataset {prefix} is empty (no non-empty document in {prefix}.idx)")
    if tokenizer is not None:
        docs.check_tokenizer(tokenizer)
    if vocab_size is not None:
        docs.check_vocab(int(vocab_size))
    return docs


def _sources(data_path, split: str, per_split):
    """(prefix, split index, bookend or None for the whole, blend weight or None) of every
    split's part: --data-path cut by --split, or each split's own blend whole."""
    if per_split is None:
        prefixes, weights = parse_blend(data_path)
        bookends = split_bookends(split)
        return [(p, s, be, None if weights is None else weights[k])
                for k, p in enumerate(prefixes) for s, be in enumerate(bookends) if be is not None]
    out = []
    for s, blend in enumerate(per_split):
        if blend:
            prefixes, weights = parse_blend(blend)
            out += [(p, s, None, None if weights is None else weights[k]) for k, p in enumerate(prefixes)]
    return out


def build_document_datasets(data_path, split: str, seed: int, max_seq_len: int,
                            split_long_documents: bool = False, cache_dir: str | None = None,
                            vocab_size: int | None = None, tokenizer=None, eval_iters: int = 0, per_split=None):
    """-> (train, valid, test); a split whose weight is 0 or that holds no document is None.
    With `eval_iters` > 0 a validation or test split that --split gives a share but that
    holds no document is refused (DataError), as the fixed-length path refuses it.
    `per_split`: [train, valid, test] blends in --data-path's syntax (None where not given),
    each split its datasets whole (upstream's --train/valid/test-data-path); `data_path` and
    `split` are then unused.

    `cache_dir` is accepted for symmetry with the fixed-length path; nothing needs caching
    (the indices are O(documents) numpy work). With `vocab_size`, token ids are checked
    against it (cheaply: see IndexedDocuments.check_vocab; then every sample as it is read);
    with `tokenizer`, against the tokenizer the data was preprocessed with. The train split must not be
    empty. Every rank builds the same datasets by itself; under torch.distributed the ranks
    first check that they read the same version of the files (one all_gather_object).
    """
    del cache_dir
    sources = _sources(data_path, split, per_split)
    opened: dict[str, IndexedDocuments] = {}
    parts_of: list[list[tuple[DocumentDataset, float]]] = [[], [], []]
    for prefix, s, be, weight in sources:
        if prefix not in opened:
            opened[prefix] = _open_checked(prefix, vocab_size, tokenizer)
        docs = opened[prefix]
        lo, hi = (0, len(docs)) if be is None else split_range(be, len(docs))
        ds = DocumentDataset(docs, (lo, hi), max_seq_len, seed, split_long_documents, SPLIT_NAMES[s])
        ds.vocab_size = None if vocab_size is None else int(vocab_size)
        if s == 0 and len(ds) and not docs.has_trainable_tokens(lo, hi):
            raise DataError(no_trainable_tokens_message(docs.prefix, "train", split))
        if len(ds):
            parts_of[s].append((ds, weight if weight is not None else float(len(ds))))
    if len({d.has_loss_mask for parts in parts_of for d, _ in parts}) > 1:
        raise DataError("--data-path mixes SFT datasets (with a loss mask) and plain ones")
    prefixes = list(opened)
    check_same_data_on_every_rank(prefixes)
    out = []
    for s, parts in enumerate(parts_of):
        if not parts:
            out.append(None)
        elif len(parts) == 1:
            out.append(parts[0][0])
        else:
            out.append(BlendedDocumentDataset([d for d, _ in parts], [w for _, w in parts]))
    asked = [any(src[1] == s for src in sources) for s in range(3)]  # a share in --split, or a path of its own
    if out[0] is None and asked[0]:
        raise DataError(f"the train split of {' '.join(prefixes)} is empty with --split {split}")
    for s in (1, 2):
        if out[s] is None and asked[s] and eval_iters > 0:
            total = sum(len(opened[p]) for p in prefixes)
            raise DataError(empty_split_message(SPLIT_NAMES[s], " ".join(prefixes), 0, total, split, eval_iters))
    return tuple(out)

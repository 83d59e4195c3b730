"""Megatron `.bin/.idx` files, checked before use, through megatron.core's IndexedDataset.

Why: megatron.core reads and writes the format (IndexedDataset, IndexedDatasetBuilder) but
reports a truncated or foreign file with a bare assert or a numpy error deep inside. Here
the header, the sizes of both files and the offsets are checked first (from the `.idx`
and the `.bin`'s size only; no token is read), so a bad file gives one DataError line
naming it. Also here:

- `IndexedDocuments`: lengths straight from the `.idx`; tokens read from the `.bin` only
  when asked; an optional per-token loss mask (SFT) stored as a parallel indexed dataset
  at `{prefix}_loss_mask` (uint8, same lengths).
- `DocumentWriter`: writes a dataset (and its mask) to temporary names and renames them
  into place at the end, so an interrupted job never leaves a half dataset behind.
- A sidecar `{prefix}.meta.json` (tokenizer, vocab size, largest token id) written by our
  preprocessing, used for a cheap vocabulary check; datasets without it are checked on
  their first documents instead.
"""
from __future__ import annotations

import json
import os
import struct
import warnings

import numpy as np

from dcp_ext.data.errors import DataError

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}
LOSS_MASK_SUFFIX = "_loss_mask"
META_SUFFIX = ".meta.json"
META_FORMAT = "dcp-data/v1"


def megatron_indexed():
    """megatron.core's indexed_dataset module, imported without its TE/apex import warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def check_prefix(prefix: str) -> dict:
    """Validate `{prefix}.idx` and `{prefix}.bin`; return header facts. Raises DataError."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    has_idx, has_bin = os.path.isfile(ipath), os.path.isfile(bpath)
    if not has_idx and not has_bin:
        raise DataError(f"no dataset at {prefix}: neither {ipath} nor {bpath} exists")
    if not has_idx:
        raise DataError(f"{ipath} not found (its .bin exists)")
    if not has_bin:
        raise DataError(f"{bpath} not found (its .idx exists)")
    size = os.path.getsize(ipath)
    with open(ipath, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < 9 or head[:9] != _HEADER:
        raise DataError(f"{ipath} is not a Megatron index file (bad header)")
    if len(head) < _HEADER_BYTES:
        raise DataError(f"{ipath} is truncated ({size} bytes, header needs {_HEADER_BYTES})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DataError(f"{ipath} has index version {version}, expected 1")
    if code not in _DTYPES:
        raise DataError(f"{ipath} has an unknown token dtype code {code}")
    expected = _HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    multimodal = False
    if size == expected + n_seq and n_seq > 0:
        multimodal = True  # sequence modes appended (multimodal datasets)
    elif size < expected:
        raise DataError(f"{ipath} is truncated ({size} bytes, its header promises {expected})")
    elif size != expected:
        raise DataError(f"{ipath} is corrupt ({size} bytes, its header promises {expected})")
    dtype = _DTYPES[code]
    itemsize = np.dtype(dtype).itemsize
    buf = np.memmap(ipath, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=_HEADER_BYTES)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=_HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=_HEADER_BYTES + 12 * n_seq)
    if n_seq:
        if lengths.min() < 0:
            raise DataError(f"{ipath} is corrupt (negative sequence length)")
        ends = np.cumsum(lengths, dtype=np.int64) * itemsize
        if pointers[0] != 0 or not np.array_equal(pointers[1:], ends[:-1]):
            raise DataError(f"{ipath} is corrupt (sequence offsets do not follow the lengths)")
        bin_expected = int(ends[-1])
    else:
        bin_expected = 0
    if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or (n_doc > 1 and np.any(np.diff(docs) < 0)):
        raise DataError(f"{ipath} is corrupt (document indices do not cover the sequences)")
    bin_size = os.path.getsize(bpath)
    if bin_size != bin_expected:
        what = "truncated" if bin_size < bin_expected else "corrupt"
        raise DataError(f"{bpath} is {what} ({bin_size} bytes, {ipath} expects {bin_expected})")
    # `lengths` views a numpy memmap that stays open as long as the array lives (megatron's
    # _IndexReader closes its map in __del__, which would leave such views dangling).
    return {"dtype": dtype, "num_sequences": int(n_seq), "num_documents": int(n_doc - 1),
            "num_tokens": bin_expected // itemsize, "multimodal": multimodal, "lengths": lengths}


def read_meta(prefix: str) -> dict | None:
    path = meta_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None


class IndexedDocuments:
    """One `.bin/.idx` prefix: sequence lengths from the `.idx`, tokens on demand."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.info = check_prefix(prefix)
        if self.info["multimodal"]:
            raise DataError(f"{idx_path(prefix)} is a multimodal index; GPT data has none")
        self.lengths: np.ndarray = self.info["lengths"]  # int32 per sequence, read from the .idx only
        self.dtype = self.info["dtype"]
        self._tokens = None
        self._mask = None
        self.mask_prefix = prefix + LOSS_MASK_SUFFIX
        self.has_loss_mask = os.path.isfile(idx_path(self.mask_prefix))
        if self.has_loss_mask:
            minfo = check_prefix(self.mask_prefix)
            if minfo["num_sequences"] != len(self.lengths) or not np.array_equal(minfo["lengths"], self.lengths):
                raise DataError(f"{idx_path(self.mask_prefix)} does not match {idx_path(prefix)} "
                                "(loss mask lengths differ from token lengths)")
        self.meta = read_meta(prefix)

    def __len__(self) -> int:
        return len(self.lengths)

    def _open(self, prefix: str):
        return megatron_indexed().IndexedDataset(prefix, multimodal=False, mmap=True)

    def tokens(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Token ids (int64, a copy: megatron's reader unmaps its buffer when it goes away)."""
        if self._tokens is None:
            self._tokens = self._open(self.prefix)
        got = self._tokens.get(int(i), offset=int(offset), length=None if length is None else int(length))
        return np.array(got, dtype=np.int64)

    def loss_mask(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray | None:
        if not self.has_loss_mask:
            return None
        if self._mask is None:
            self._mask = self._open(self.mask_prefix)
        got = self._mask.get(int(i), offset=int(offset), length=None if length is None else int(length))
        return np.array(got, dtype=np.uint8)

    def check_vocab(self, vocab_size: int, first: int = 64) -> None:
        """Raise DataError if a token id >= vocab_size: from the meta file, else the first docs."""
        if self.meta and self.meta.get("max_token_id") is not None:
            top, where = int(self.meta["max_token_id"]), meta_path(self.prefix)
        else:
            n = min(first, len(self))
            top = max((int(self.tokens(i).max()) for i in range(n) if self.lengths[i] > 0), default=-1)
            where = f"the first {n} documents"
        if top >= vocab_size:
            raise DataError(f"vocabulary mismatch: {self.prefix} has token id {top} (from {where}) "
                            f">= tokenizer vocab size {vocab_size}; was it preprocessed with another tokenizer?")


class DocumentWriter:
    """Write documents (and optional loss masks) to `{prefix}.bin/.idx` atomically."""

    def __init__(self, prefix: str, vocab_size: int, loss_mask: bool = False):
        mi = megatron_indexed()
        self.prefix = prefix
        self.dtype = mi.DType.optimal_dtype(vocab_size)  # as Megatron's preprocess_data.py
        self.vocab_size = vocab_size
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp = f"{prefix}.tmp{os.getpid()}"
        self._builder = mi.IndexedDatasetBuilder(bin_path(self._tmp), dtype=self.dtype)
        self._mask_builder = None
        if loss_mask:
            self._mask_builder = mi.IndexedDatasetBuilder(bin_path(self._tmp + LOSS_MASK_SUFFIX), dtype=np.uint8)
        self.num_documents = 0
        self.num_tokens = 0
        self.max_token_id = -1

    def add(self, tokens, loss_mask=None) -> None:
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        self._builder.add_document(arr, [arr.size])
        if self._mask_builder is not None:
            mask = np.asarray(loss_mask, dtype=np.uint8)
            assert mask.shape == arr.shape, "loss mask and tokens differ in length"
            self._mask_builder.add_document(mask, [mask.size])
        self.num_documents += 1
        self.num_tokens += int(arr.size)
        self.max_token_id = max(self.max_token_id, int(arr.max()))

    def finalize(self, meta: dict | None = None) -> None:
        pairs = [(self._builder, self._tmp, self.prefix)]
        if self._mask_builder is not None:
            pairs.append((self._mask_builder, self._tmp + LOSS_MASK_SUFFIX, self.prefix + LOSS_MASK_SUFFIX))
        for builder, tmp, _ in pairs:
            builder.finalize(idx_path(tmp))
        # .bin first, .idx last: a complete .idx means a complete dataset.
        for _, tmp, final in pairs[::-1]:
            os.replace(bin_path(tmp), bin_path(final))
            os.replace(idx_path(tmp), idx_path(final))
        info = {"format": META_FORMAT, "num_documents": self.num_documents, "num_tokens": self.num_tokens,
                "max_token_id": self.max_token_id, "vocab_size": self.vocab_size,
                "dtype": np.dtype(self.dtype).name, "loss_mask": self._mask_builder is not None}
        info.update(meta or {})
        tmp_meta = meta_path(self._tmp)
        with open(tmp_meta, "w") as f:
            json.dump(info, f, indent=1, default=str)
        os.replace(tmp_meta, meta_path(self.prefix))

    def abort(self) -> None:
        for b in (self._builder, self._mask_builder):
            if b is not None:
                try:
                    b.data_file.close()
                except Exception:
                    pass
        for base in (self._tmp, self._tmp + LOSS_MASK_SUFFIX):
            for p in (bin_path(base), idx_path(base), meta_path(base)):
                if os.path.exists(p):
                    os.remove(p)


def write_documents(prefix: str, docs, vocab_size: int, loss_masks=None, meta: dict | None = None) -> str:
    """Write token-id documents (lists/arrays) as a dataset at `prefix`; return the prefix.

    For tests, benchmarks and synthetic data; preprocessing goes through the same writer.
    """
    w = DocumentWriter(prefix, vocab_size, loss_mask=loss_masks is not None)
    try:
        for k, d in enumerate(docs):
            w.add(d, None if loss_masks is None else loss_masks[k])
        w.finalize(meta)
    except BaseException:
        w.abort()
        raise
    return prefix

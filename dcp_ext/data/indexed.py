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
    for path in (ipath, bpath):
        _check_readable_file(path)
    has_idx, has_bin = os.path.isfile(ipath), os.path.isfile(bpath)
    if not has_idx and not has_bin:
        hint = ""
        if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix):
            hint = f" (--data-path takes the prefix without .bin/.idx: {prefix[:-4]})"
        raise DataError(f"no dataset at {prefix}: neither {ipath} nor {bpath} exists{hint}")
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


def _check_readable_file(path: str) -> None:
    """A data file that exists but cannot be read: said as such (not as a missing file or a traceback)."""
    if os.path.islink(path) and not os.path.exists(path):
        raise DataError(f"{path} is a broken symbolic link (to {os.readlink(path)}): is its filesystem mounted?")
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory, not a data file")
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def fingerprint(prefix: str, edge: int = 1 << 20) -> tuple:
    """What identifies a dataset's version without reading it: the sizes of its files and a
    CRC of the first and last MiB of its `.idx` (lengths and offsets of the first and last
    documents), plus its loss mask's sizes. The path is not part of it."""
    import zlib

    def crc_of(path: str) -> int:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(edge)
            f.seek(max(size - edge, 0))
            return zlib.crc32(f.read(edge), zlib.crc32(head))

    parts = [os.path.getsize(idx_path(prefix)), os.path.getsize(bin_path(prefix)), crc_of(idx_path(prefix))]
    mask = prefix + LOSS_MASK_SUFFIX
    if os.path.isfile(idx_path(mask)):
        parts += [os.path.getsize(idx_path(mask)), os.path.getsize(bin_path(mask))]
    return tuple(parts)


def check_same_data_on_every_rank(prefixes) -> None:
    """Collective when torch.distributed runs with several ranks (a no-op otherwise): every
    rank must read the same version of every dataset. Nodes with their own copies of the data
    (a stale copy, a sync still running) would otherwise train on different batches, or hang.
    Call it on every rank, after each has checked its files."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    ours = [fingerprint(p) for p in prefixes]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ours)
    for rank, theirs in enumerate(every):
        for prefix, a, b in zip(prefixes, every[0], theirs):
            if a != b:
                raise DataError(f"rank {rank} reads another version of {prefix} than rank 0 (.idx/.bin of "
                                f"{b[0]}/{b[1]} bytes vs {a[0]}/{a[1]}, or other contents): every node must see "
                                "the same data files (a stale copy, or a copy still being written?)")


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
        self.mask_dtype = np.uint8
        if self.has_loss_mask:
            minfo = check_prefix(self.mask_prefix)
            self.mask_dtype = minfo["dtype"]
            if minfo["num_sequences"] != len(self.lengths) or not np.array_equal(minfo["lengths"], self.lengths):
                raise DataError(f"{idx_path(self.mask_prefix)} does not match {idx_path(prefix)} "
                                "(loss mask lengths differ from token lengths)")
        self.meta = read_meta(prefix)
        from dcp_ext.data import file_guard

        # memory-mapped for the whole run: a change under it is said in one line (file_guard)
        file_guard.watch(idx_path(prefix), bin_path(prefix),
                         *((idx_path(self.mask_prefix), bin_path(self.mask_prefix)) if self.has_loss_mask else ()))

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

    def check_token_ids(self, tokens: np.ndarray, vocab_size: int, doc: int) -> None:
        """The check every micro-batch makes on the tokens it reads (a max and a min): a token id
        outside the vocabulary would index past the embedding table mid-run."""
        if tokens.size and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
            bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
            raise DataError(f"vocabulary mismatch: {bin_path(self.prefix)} document {int(doc)} has token id {bad}, "
                            f"outside the tokenizer's vocabulary of {vocab_size}; was it preprocessed with another "
                            "tokenizer, or is the file damaged?")

    def has_trainable_tokens(self, lo: int = 0, hi: int | None = None, chunk: int = 1 << 24) -> bool:
        """Whether the loss mask of sequences lo..hi-1 marks any token (plain data: always).
        Reads the uint8 mask in chunks and stops at the first marked token."""
        if not self.has_loss_mask:
            return True
        hi = len(self) if hi is None else hi
        if hi <= lo:
            return False
        starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        a, b = int(starts[lo]), int(starts[hi])
        mask = np.memmap(bin_path(self.mask_prefix), mode="r", dtype=self.mask_dtype)
        try:
            return any(bool(mask[i:min(i + chunk, b)].any()) for i in range(a, b, chunk))
        finally:
            del mask

    def check_tokenizer(self, tokenizer) -> None:
        """Data preprocessed with one tokenizer (its meta file says which), trained with another:
        the ids mean other words and EOD is another id. Compared by vocabulary size and EOD id;
        NullTokenizer (how Megatron trains on pre-tokenized data) is never refused."""
        saved = (self.meta or {}).get("tokenizer")
        ours = dict(getattr(tokenizer, "unique_identifiers", None) or {})
        if not isinstance(saved, dict) or not ours or "NullTokenizer" in (saved.get("class"), ours.get("class")):
            return
        for key in ("vocab_size", "eod"):
            if saved.get(key) is not None and ours.get(key) is not None and saved[key] != ours[key]:
                raise DataError(f"tokenizer mismatch: {self.prefix} was preprocessed with {saved.get('class')} "
                                f"(vocab {saved.get('vocab_size')}, EOD {saved.get('eod')}; {meta_path(self.prefix)}), "
                                f"this run uses {ours.get('class')} (vocab {ours.get('vocab_size')}, EOD "
                                f"{ours.get('eod')}): pass the tokenizer flags it was preprocessed with")

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

    def add(self, tokens, loss_mask=None, lengths=None) -> None:
        """One document. `lengths`: the token counts of its sequences (upstream's sentence
        lengths: a list-valued JSON field is one sequence per item); one sequence by default.
        An empty document is recorded as upstream's preprocess_data.py records it: a document
        with no sequence, so datasets of several --json-keys line up document for document,
        and the readers, which index sequences (as megatron-core's GPTDataset), never see it."""
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if lengths is None:
            lengths = [int(arr.size)] if arr.size else []
        lengths = [int(n) for n in lengths]
        assert sum(lengths) == arr.size and all(n > 0 for n in lengths), "sequence lengths must cover the tokens"
        self._builder.add_document(arr, lengths)
        if self._mask_builder is not None:
            mask = np.asarray(loss_mask if arr.size else [], dtype=np.uint8)
            assert mask.shape == arr.shape, "loss mask and tokens differ in length"
            self._mask_builder.add_document(mask, lengths)
        self.num_documents += 1
        if arr.size:
            self.num_tokens += int(arr.size)
            self.max_token_id = max(self.max_token_id, int(arr.max()))

    def add_dataset(self, prefix: str, meta: dict) -> None:
        """Append a whole dataset this writer's way wrote (`meta`: its .meta.json), as
        megatron-core's builder merges partitions (`add_index`)."""
        self._builder.add_index(prefix)
        if self._mask_builder is not None:
            self._mask_builder.add_index(prefix + LOSS_MASK_SUFFIX)
        self.num_documents += int(meta["num_documents"])
        self.num_tokens += int(meta["num_tokens"])
        self.max_token_id = max(self.max_token_id, int(meta["max_token_id"]))

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

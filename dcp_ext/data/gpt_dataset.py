"""Upstream Megatron's fixed-length data path: megatron.core's GPTDataset through its builder.

Why: the baseline (and any user who wants Megatron's exact data) trains on documents
concatenated into `seq_length` samples. This only wires megatron.core's
`BlendedMegatronDatasetBuilder(GPTDataset, ...)` to our tokenizers and checks the files
first, so a bad path or file is one DataError line instead of an assert.

torch.distributed: call this on every rank *after* `init_process_group` (gloo or NCCL) in a
multi-rank job: the builder then builds (and caches) on rank 0 first, with barriers, and
the other ranks load the cache. Without torch.distributed (one process, tests, tools) it
works too: a blend of several prefixes needs a process group inside megatron.core, so a
private one-rank gloo group is opened for the build and closed after. Never call it
before init_process_group from several processes at once (they would race on the cache).
No CUDA is needed.
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings

import numpy as np

from dcp_ext.data.documents import (empty_split_message, no_trainable_tokens_message, parse_blend, split_bookends,
                                    split_range)
from dcp_ext.data.data_paths import default_cache_dirs
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import IndexedDocuments, check_same_data_on_every_rank, megatron_indexed


@contextlib.contextmanager
def _process_group_for_builder():
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_splits_have_tokens(docs: IndexedDocuments, bookends, sizes, split, eval_iters=None) -> None:
    """megatron-core's GPTDataset loops for ever on a split that holds no token (it counts
    epochs by tokens per epoch); refuse it up front, and an SFT train split whose loss mask
    marks nothing (it would train at loss 0). Document ranges as megatron-core cuts them."""
    prefix, lengths = docs.prefix, docs.lengths
    n = len(lengths)
    for k, (name, bookend, size) in enumerate(zip(("train", "valid", "test"), bookends, sizes)):
        if bookend is None or not size:
            continue
        lo, hi = split_range(bookend, n)
        if int(lengths[lo:hi].sum()) == 0:
            if k == 0:
                raise DataError(f"the train split of {prefix} has no tokens with --split {split} ({n} documents): "
                                "use more data or another --split")
            raise DataError(empty_split_message(name, prefix, hi - lo, n, split, eval_iters))
        if k == 0 and not docs.has_trainable_tokens(lo, hi):
            raise DataError(no_trainable_tokens_message(prefix, name, split))


class _CheckedReads:
    """A megatron.core IndexedDataset whose reads are checked against the vocabulary: the
    check every micro-batch makes (a max and a min of what was read), before GPTDataset pads
    and replaces its pad id (-1) by 0, so no id escapes it. Names the document."""

    def __init__(self, indexed, docs: IndexedDocuments, vocab_size: int):
        self._indexed, self._docs, self._vocab = indexed, docs, vocab_size

    def get(self, idx, offset=0, length=None):
        arr = self._indexed.get(idx, offset=offset, length=length)
        self._docs.check_token_ids(np.asarray(arr), self._vocab, int(idx))
        return arr

    def __getattr__(self, name):  # sequence_lengths, document_indices, ...
        return getattr(self.__dict__["_indexed"], name)

    def __len__(self):
        return len(self._indexed)


class CheckedSamples:
    """A megatron.core GPTDataset whose samples carry the stored SFT loss mask and whose token
    ids are checked against the vocabulary as each micro-batch is built (`_CheckedReads`).

    GPTDataset concatenates documents into `seq_length` windows and knows nothing of a loss
    mask: it would train on the prompts. The mask is a parallel indexed dataset with the same
    sequence lengths, so the very same document/sample/shuffle indices cut it into the same
    windows (a shallow copy of the dataset reading the mask file instead of the tokens). As on
    the --dcp path, the mask acts on the label side: position j counts when token j+1 is a
    response token.
    """

    def __init__(self, dataset, docs: IndexedDocuments, vocab_size: int):
        self.dataset, self.docs, self.vocab_size = dataset, docs, int(vocab_size)
        self._mask_view = None
        if docs.has_loss_mask:
            self._mask_view = copy.copy(dataset)
            self._mask_view.dataset = megatron_indexed().IndexedDataset(docs.mask_prefix, multimodal=False, mmap=True)
        dataset.dataset = _CheckedReads(dataset.dataset, docs, self.vocab_size)  # its indices are built: reads only

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # everything else is the GPTDataset's (config, index_split, ...)
        return getattr(self.__dict__["dataset"], name)

    def __getitem__(self, idx):
        item = self.dataset[idx]
        if self._mask_view is not None:
            import torch

            text, _ = self._mask_view._query_document_sample_shuffle_indices(idx)
            shift = int(self.dataset.config.add_extra_token_to_sequence)
            response = np.asarray(text[shift : shift + item["labels"].numel()]) > 0
            item["loss_mask"] = item["loss_mask"] * torch.from_numpy(response).to(item["loss_mask"].dtype)
        return item


def damaged_cache_files(cache_dir: str) -> list[str]:
    """The index files (.npy) megatron.core cached in `cache_dir` that do not load: a truncated
    write (a killed job, or another job writing the same cache right now)."""
    out = []
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".npy"):
            continue
        path = os.path.join(cache_dir, name)
        try:
            np.load(path, allow_pickle=False, mmap_mode="r")
        except (ValueError, EOFError, OSError):
            out.append(path)
    return out


def _checked(dataset, docs_by_path: dict, vocab_size: int):
    """Wrap every GPTDataset (also inside a BlendedDataset) in CheckedSamples."""
    if dataset is None:
        return None
    if hasattr(dataset, "datasets"):  # BlendedDataset: it indexes self.datasets[k][i]
        dataset.datasets = [_checked(d, docs_by_path, vocab_size) for d in dataset.datasets]
        return dataset
    return CheckedSamples(dataset, docs_by_path[dataset.dataset_path], vocab_size)


def _checked_documents(prefix: str, tokenizer) -> IndexedDocuments:
    docs = IndexedDocuments(prefix)
    if len(docs) == 0 or int(docs.lengths.sum()) == 0:
        raise DataError(f"dataset {prefix} is empty (no token in {prefix}.idx)")
    docs.check_tokenizer(tokenizer)
    docs.check_vocab(int(tokenizer.vocab_size))
    return docs


def _per_split_blends(per_split, sizes) -> list:
    """--train/valid/test-data-path as megatron-core's blend_per_split: (prefixes, weights) or
    None per split; a split nothing asks samples of is not built."""
    return [parse_blend(b) if b and n else None for b, n in zip(per_split, sizes)]


def build_fixed_length_datasets(data_path, split: str, seq_length: int, seed: int, tokenizer,
                                num_samples, cache_dir: str | None, reset_position_ids: bool = False,
                                reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                                create_attention_mask: bool = False, eval_iters: int | None = None,
                                per_split=None):
    """-> (train, valid, test) megatron.core GPTDatasets (or BlendedDatasets); None for a 0 split.
    A split asked for samples that holds no token is refused (`eval_iters`: named in the line).
    `per_split`: [train, valid, test] blends in --data-path's syntax (None where not given),
    each split its datasets whole (upstream's --train/valid/test-data-path); `data_path` and
    `split` are then unused. `cache_dir` None: megatron-core's default, next to the data.

    Items: {'tokens', 'labels', 'loss_mask', 'position_ids'} torch tensors of seq_length
    (plus 'attention_mask' with create_attention_mask). `num_samples`: (train, valid, test)
    sample counts, as Megatron computes them from --train-iters etc.
    """
    if seq_length < 1:
        raise DataError("--seq-length must be >= 1")
    if len(num_samples) != 3:
        raise DataError("num_samples must be (train, valid, test)")
    sizes = [None if n is None else int(n) for n in num_samples]
    docs_by_path = {}
    if per_split is not None:
        blends = _per_split_blends(per_split, sizes)
        prefixes = list(dict.fromkeys(p for b in blends if b for p in b[0]))
        for prefix in prefixes:
            docs_by_path[prefix] = _checked_documents(prefix, tokenizer)
        blend_args = dict(blend=None, blend_per_split=blends, split=None)
    else:
        prefixes, weights = parse_blend(data_path)
        bookends = split_bookends(split)
        for prefix in prefixes:
            docs = _checked_documents(prefix, tokenizer)
            _check_splits_have_tokens(docs, bookends, sizes, split, eval_iters)
            docs_by_path[prefix] = docs
        if weights is not None and any(n is None for n, be in zip(sizes, bookends) if be is not None):
            raise DataError("a weighted --data-path blend needs a sample count for every non-empty split")
        blend_args = dict(blend=(prefixes, weights), split=split)
    if len({d.has_loss_mask for d in docs_by_path.values()}) > 1:
        raise DataError("--data-path mixes SFT datasets (with a loss mask) and plain ones")
    check_same_data_on_every_rank(prefixes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), **blend_args,
        path_to_cache=cache_dir, tokenizer=tokenizer, mmap_bin_files=True,
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
    )
    with _process_group_for_builder():
        try:
            train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        except (ValueError, EOFError, OSError) as e:
            cache_dirs = [cache_dir] if cache_dir is not None else default_cache_dirs(prefixes)
            damaged = [f for d in cache_dirs for f in damaged_cache_files(d)]
            if not damaged:
                raise
            raise DataError(f"data cache file {damaged[0]} is damaged (cut short: another job may be writing the "
                            f"same --data-cache-path, or one was killed while writing it): delete it, or use "
                            f"another --data-cache-path, and rerun ({type(e).__name__}: {str(e)[:80]})") from None
    vocab = int(tokenizer.vocab_size)
    return tuple(_checked(d, docs_by_path, vocab) for d in (train, valid, test))


def build_mock_fixed_length_datasets(seq_length: int, seed: int, tokenizer, num_samples, cache_dir: str | None,
                                     reset_position_ids: bool = False, reset_attention_mask: bool = False,
                                     eod_mask_loss: bool = False):
    """`--mock-data` on the static path: megatron-core's MockGPTDataset (synthetic documents
    concatenated into `seq_length` windows, as upstream Megatron's `--mock-data` trains on),
    through the same builder. -> (train, valid, test); a split with no samples asked is None."""
    if seq_length < 1:
        raise DataError("--seq-length must be >= 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    sizes = [int(n) if n else None for n in num_samples]
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), blend=None, path_to_cache=cache_dir,
        tokenizer=tokenizer, mmap_bin_files=False, reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss, create_attention_mask=False,
    )
    with _process_group_for_builder():
        return tuple(BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, config).build())

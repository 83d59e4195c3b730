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
import os
import warnings

from dcp_ext.data.documents import parse_blend, split_bookends
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import IndexedDocuments


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


def _check_splits_have_tokens(prefix, lengths, bookends, sizes, split) -> None:
    """megatron-core's GPTDataset loops for ever on a split that holds no token (it counts
    epochs by tokens per epoch); refuse it up front. Document ranges as megatron-core cuts them."""
    n = len(lengths)
    starts = [0]
    for bookend in bookends:  # megatron-core rounds each part's share, then accumulates
        starts.append(starts[-1] + (0 if bookend is None else int(round((bookend[1] - bookend[0]) * n))))
    for k, (name, bookend, size) in enumerate(zip(("train", "valid", "test"), bookends, sizes)):
        if bookend is None or not size:
            continue
        lo, hi = min(starts[k], n), min(starts[k + 1], n)
        if int(lengths[lo:hi].sum()) == 0:
            raise DataError(f"the {name} split of {prefix} has no tokens with --split {split} ({n} documents): "
                            f"use more data, another --split, or --eval-iters 0")


def build_fixed_length_datasets(data_path, split: str, seq_length: int, seed: int, tokenizer,
                                num_samples, cache_dir: str, reset_position_ids: bool = False,
                                reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                                create_attention_mask: bool = False):
    """-> (train, valid, test) megatron.core GPTDatasets (or BlendedDatasets); None for a 0 split.

    Items: {'tokens', 'labels', 'loss_mask', 'position_ids'} torch tensors of seq_length
    (plus 'attention_mask' with create_attention_mask). `num_samples`: (train, valid, test)
    sample counts, as Megatron computes them from --train-iters etc.
    """
    if seq_length < 1:
        raise DataError("--seq-length must be >= 1")
    prefixes, weights = parse_blend(data_path)
    bookends = split_bookends(split)
    if len(num_samples) != 3:
        raise DataError("num_samples must be (train, valid, test)")
    sizes = [None if n is None else int(n) for n in num_samples]
    for prefix in prefixes:
        docs = IndexedDocuments(prefix)
        if len(docs) == 0 or int(docs.lengths.sum()) == 0:
            raise DataError(f"dataset {prefix} is empty (no token in {prefix}.idx)")
        docs.check_vocab(int(tokenizer.vocab_size))
        _check_splits_have_tokens(prefix, docs.lengths, bookends, sizes, split)
    if weights is not None and any(n is None for n, be in zip(sizes, bookends) if be is not None):
        raise DataError("a weighted --data-path blend needs a sample count for every non-empty split")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    os.makedirs(cache_dir, exist_ok=True)
    config = GPTDatasetConfig(
        random_seed=int(seed), sequence_length=int(seq_length), blend=(prefixes, weights), split=split,
        path_to_cache=cache_dir, tokenizer=tokenizer, mmap_bin_files=True,
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
    )
    with _process_group_for_builder():
        train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid, test

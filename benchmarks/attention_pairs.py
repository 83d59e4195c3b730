"""Attention work per token: whole documents (`--dcp`) vs documents cut at sample boundaries.

Why it exists: at a fixed layout `--dcp` and megatron-core train the same tokens but not the
same attention. Megatron concatenates documents and cuts the stream into --seq-length
samples (with --reset-attention-mask a document crossing a boundary becomes two that do
not see each other); `--dcp` keeps every document whole, split only past --dcp-max-seq-len.
Causal attention costs about s² per document of s tokens, so this prints the pairs per
token both ways (and their ratio) for a shipped length file: the extra work `--dcp`
does for the full-document objective, which a tokens/s ratio does not show.

    python benchmarks/attention_pairs.py                              # the bench's default corpus
    python benchmarks/attention_pairs.py --lengths code_python_cl100k.txt --seq-length 4096
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dcp_ext.data.lengths import read_lengths  # noqa: E402


def whole_documents(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Documents as `--dcp --dcp-split-long-documents` trains them: split only past max_len."""
    full, rest = np.divmod(lengths, max_len)
    return np.concatenate([np.full(int(full.sum()), max_len), rest[rest > 0]])


def sample_cut(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """The pieces of each document once the concatenated stream is cut every seq_length tokens."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cuts = np.arange(seq_length, int(ends[-1]), seq_length)
    bounds = np.union1d(np.concatenate([starts, ends]), cuts)
    return np.diff(bounds)


def pairs_per_token(pieces: np.ndarray) -> float:
    p = pieces.astype(float)
    return float((p * p).sum() / p.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="text_reuters21578_cl100k.txt", help="a file of ../shared/data/lengths/")
    ap.add_argument("--seq-length", type=int, default=2048, help="megatron-core's sample length (and --dcp-max-seq-len)")
    ap.add_argument("--seed", type=int, default=0, help="document order (megatron shuffles)")
    a = ap.parse_args(argv)
    lengths = np.random.default_rng(a.seed).permutation(np.asarray(read_lengths(a.lengths), dtype=np.int64))
    dcp = pairs_per_token(whole_documents(lengths, a.seq_length))
    mcore = pairs_per_token(sample_cut(lengths, a.seq_length))
    print(f"{a.lengths}, {len(lengths):,} documents, samples of {a.seq_length} tokens: attention pairs per token "
          f"--dcp {dcp:.0f}, megatron-core {mcore:.0f}: --dcp does {dcp / mcore:.3f}x the attention work per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Shared fixtures: a small real-text corpus and the tiny model's Megatron flags."""
import glob
import json
import os

import numpy as np
import pytest

# A tiny Llama-style GPT: RoPE, GQA (4 heads, 2 groups), SwiGLU, RMSNorm; fp32.
# Vocabulary: 255 byte values + EOD = 256 ids, which pads to 256 under TP1 and TP2 alike
# (Megatron pads to a multiple of 128*tp; a different padding would be a different model).
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--ffn-hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--lr-decay-iters", "8", "--clip-grad", "1.0", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "0", "--split", "100,0,0",
]


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> str:
    """Byte-valued documents cut from real source files, ~20 to ~600 tokens, EOD = 255."""
    from dcp_ext.data.indexed import write_documents

    root = tmp_path_factory.mktemp("corpus")
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    rng = np.random.default_rng(0)
    docs = []
    for path in files:
        data = open(path, "rb").read()
        for _ in range(8):
            n = int(rng.integers(20, 600))
            start = int(rng.integers(0, max(1, len(data) - n)))
            docs.append([min(b, 254) for b in data[start : start + n]] + [255])
    return write_documents(str(root / "corpus_text_document"), docs, vocab_size=256)

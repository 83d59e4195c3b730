"""A long-tailed corpus for the benchmarks: real text, real document lengths.

Why it exists: the demo corpus (standard-library modules cut into top-level blocks) holds a
2048-token block in nearly every 8192-token batch, so a benchmark on it measures one layout
over and over. Real pre-training corpora are long-tailed: most documents short, a few long.
This writes `.bin/.idx` documents whose lengths are the first documents of a shipped length
file (`../shared/data/lengths/`, default `text_reuters21578_cl100k.txt`: Reuters-21578
news, median 154 tokens, p99 993, max 5,651) and whose tokens are consecutive bytes of the
demo corpus (this Python's standard-library sources, byte-level), each document ended by
EOD. Built once per (length file, document count) under the cache directory. "uniform:N"
instead of a length file: every document N tokens (the control where no layout change helps).
"""
from __future__ import annotations

import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS_DIR = os.path.join(os.path.dirname(REPO), "shared", "data", "lengths")
DEFAULT_LENGTHS = "text_reuters21578_cl100k.txt"
UNIFORM_DOCUMENTS = 20_000  # "uniform:N": a corpus of this many N-token documents


def lengths_file(name: str) -> str:
    path = name if os.path.sep in name else os.path.join(LENGTHS_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"length file {path} not found (the shipped ones are in {LENGTHS_DIR})")
    return path


def ensure_long_tail_corpus(cache_dir: str, lengths_name: str = DEFAULT_LENGTHS, documents: int = 0) -> str:
    """The corpus's data prefix (for --data-path), built on first use; `documents` 0: every length of the file."""
    from dcp_ext.data.demo_corpus import ensure_demo_corpus
    from dcp_ext.data.indexed import DocumentWriter, IndexedDocuments
    from dcp_ext.data.tokenizers import ByteLevelTokenizer

    if lengths_name.startswith("uniform:"):  # every document the same length: N, 20,000 of them
        path, stem = None, f"uniform_{int(lengths_name.split(':', 1)[1])}"
    else:
        path = lengths_file(lengths_name)
        stem = os.path.splitext(os.path.basename(path))[0]
    prefix = os.path.join(os.path.abspath(cache_dir), f"long_tail_{stem}" + (f"_n{documents}" if documents else ""), "text_document")
    if os.path.isfile(prefix + ".meta.json"):
        return prefix
    lengths = (np.full(UNIFORM_DOCUMENTS, int(stem.split("_")[1]), dtype=np.int64) if path is None
               else np.loadtxt(path, dtype=np.int64))
    lengths = lengths[:documents] if documents else lengths
    source = IndexedDocuments(ensure_demo_corpus(cache_dir))
    tok = ByteLevelTokenizer()
    text = _text_stream(source, tok.eod, int(lengths.sum()))
    writer = DocumentWriter(prefix, tok.vocab_size)
    try:
        at = 0
        for n in lengths:
            body = text[at: at + int(n) - 1]  # the EOD makes it n tokens
            at += len(body)
            writer.add(np.append(body, np.uint16(tok.eod)))
        writer.finalize({"tokenizer": dict(tok.unique_identifiers), "eod": tok.eod, "append_eod": True,
                         "source": f"demo corpus bytes cut to the lengths of {os.path.basename(path) if path else stem}"})
    except BaseException:
        writer.abort()
        raise
    return prefix


def _text_stream(source, eod: int, need: int) -> np.ndarray:
    """`need` tokens of the source's documents, EODs dropped, repeated if it is short."""
    parts, have, i = [], 0, 0
    while have < need:
        t = np.asarray(source.tokens(i % len(source)), dtype=np.uint16)
        t = t[t != eod]
        parts.append(t)
        have += t.size
        i += 1
    return np.concatenate(parts)

#!/usr/bin/env python
"""Write the long-context length mix (documents up to 640K tokens) from the shipped length files.

Why it exists: the shipped distributions stop at 167K tokens (code files) and 126K
(chat contexts), while long-context training mixes carry repository-level documents of
hundreds of thousands of tokens. This recipe builds such a mix from the shipped, real
lengths only, deterministically, so the benchmark that uses it (benchmarks/
bench_long_context.py) can be re-run and its input re-derived from scratch.

Recipe (version 1):
  1. repositories: the files of `code_python_cl100k.txt`, in file order (shuffled at the
     source), are cut into consecutive runs; a run's file count is drawn from a Zipf law
     (P(K >= k) = 1/k, k = floor(U^-1), U uniform in (0, 1], numpy PCG64 seed 0, one
     draw per repository), and a run closes early before the file that would take it past
     640Ki = 655360 tokens; each run is one document whose length is the sum of its files';
  2. chat contexts: `mooncake_conversation_input_tokens.txt` as it is;
  3. papers: `arxiv_summarization_total_llama2.txt` as it is;
  4. the three lists concatenated (1, 2, 3) and shuffled with numpy PCG64 seed 1.

    python tools/long_context_lengths.py            # writes benchmarks/data/long_context_mix.txt
    python tools/long_context_lengths.py --check    # re-derives and compares with the committed file
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dcp_ext.data.lengths import DATA_DIR, read_lengths  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "data", "long_context_mix.txt")
CAP = 655360  # 640Ki tokens: the longest repository document
SOURCES = ("code_python_cl100k.txt", "mooncake_conversation_input_tokens.txt", "arxiv_summarization_total_llama2.txt")


def repositories(files: list[int], cap: int = CAP, seed: int = 0) -> list[int]:
    """Step 1: consecutive files grouped into repository documents (Zipf file counts, <= cap)."""
    rng = np.random.default_rng(seed)
    out, i = [], 0
    while i < len(files):
        k = int(np.floor((1.0 - rng.random()) ** -1.0))  # 1 - U is in (0, 1]: no division by zero
        total, n = 0, 0
        while i < len(files) and n < k and (n == 0 or total + files[i] <= cap):
            total += files[i]
            i += 1
            n += 1
        out.append(total)
    return out


def long_context_mix(data_dir: str = DATA_DIR) -> list[int]:
    code, chat, papers = (read_lengths(os.path.join(data_dir, f)) for f in SOURCES)
    docs = np.asarray(repositories(code) + chat + papers, dtype=np.int64)
    return docs[np.random.default_rng(1).permutation(len(docs))].tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--data", default=DATA_DIR, help="directory of the shipped length files")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = ap.parse_args(argv)
    docs = long_context_mix(a.data)
    text = "".join(f"{n}\n" for n in docs)
    if a.check:
        with open(a.out) as f:
            same = f.read() == text
        print(f"{a.out}: {'matches' if same else 'DIFFERS from'} the recipe")
        return 0 if same else 1
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    s = np.asarray(docs)
    print(f"wrote {a.out}: {len(s)} documents, {int(s.sum())} tokens, median {int(np.median(s))}, "
          f"p99 {int(np.quantile(s, 0.99))}, max {int(s.max())}, {int((s > 131072).sum())} over 128K")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

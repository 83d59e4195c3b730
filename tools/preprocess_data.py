#!/usr/bin/env python
"""Megatron's preprocess_data.py for this fork: JSONL -> {prefix}_{key}_document.bin/.idx.

Thin entry point; the logic (and its tests) live in dcp_ext/data/preprocess.py.
Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --append-eod --workers 4
SFT (loss on the response only): add --sft (prompt/response or chat "messages" lines).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_ext.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

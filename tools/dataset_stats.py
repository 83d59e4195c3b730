#!/usr/bin/env python
"""Length histogram (a table; a PNG only where --png says) and padding overhead (Megatron packing vs
THD) of a dataset.

Thin entry point; the logic lives in dcp_ext/data/stats_report.py. Examples:
    python tools/dataset_stats.py --data-path data/corpus_text_document --seq-length 4096
    python tools/dataset_stats.py --demo --seq-length 1024 --png demo_lengths.png
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_ext.data.stats_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/attention_pairs.py: the pieces each path trains, by hand on a small stream."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from attention_pairs import pairs_per_token, sample_cut, whole_documents  # noqa: E402


def test_documents_cut_at_sample_boundaries_and_split_past_the_maximum():
    lengths = np.array([3, 6, 2, 9])  # stream 0-3 | 3-9 | 9-11 | 11-20, samples of 4 tokens
    assert sample_cut(lengths, 4).tolist() == [3, 1, 4, 1, 2, 1, 4, 4]
    assert sorted(whole_documents(lengths, 4).tolist()) == sorted([3, 4, 2, 2, 4, 4, 1])
    assert sample_cut(lengths, 4).sum() == whole_documents(lengths, 4).sum() == lengths.sum()
    assert pairs_per_token(np.array([2, 2])) == 2.0 and pairs_per_token(np.array([4])) == 4.0

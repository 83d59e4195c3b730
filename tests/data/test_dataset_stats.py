"""Length histogram and padding overhead (the function and tools/dataset_stats.py)."""
import json
import os

import numpy as np
import pytest

from dcp_ext.data.indexed import write_documents
from dcp_ext.data.stats import length_histogram, padding_overhead
from dcp_ext.data.stats_report import main


def test_histogram_power_of_two_buckets():
    h = length_histogram([1, 2, 3, 4, 7, 8, 100])
    rows = {(lo, hi): n for lo, hi, n, _, _ in h.rows()}
    assert rows == {(1, 2): 1, (2, 4): 2, (4, 8): 2, (8, 16): 1, (64, 128): 1}
    assert h.num_documents == 7 and h.num_tokens == 125 and h.tokens.sum() == 125
    assert h.percentiles[100] == 100


def test_padding_overhead_figures():
    f = padding_overhead([3, 5, 8, 1], seq_length=8, cp=2, tp=1)
    # real 17 tokens; pad each to 8: 32 slots; best fit: {8}, {5,3}, {1} -> 3 bins = 24 slots
    assert f["pad_to_seq_length"] == pytest.approx((32 - 17) / 17)
    assert f["packed_best_fit"] == pytest.approx((24 - 17) / 17) and f["packed_bins"] == 3
    # ours: multiples of 2*cp = 4 -> 4 + 8 + 8 + 4 = 24
    assert f["pad_multiple"] == 4 and f["thd_ours"] == pytest.approx((24 - 17) / 17)
    assert padding_overhead([3, 5, 8, 1], 8)["thd_ours"] == 0.0
    assert padding_overhead([4, 4], 8, tp=2)["pad_multiple"] == 2  # sequence parallel by default with tp
    # concatenation: stream 3+5 in windows of 4 -> full causal 2 * 10 vs document pieces 3,1,4 -> 6+1+10
    assert padding_overhead([3, 5], 4)["concat_attention"] == pytest.approx(20 / 17 - 1)
    # lengths are truncated to seq_length first
    assert padding_overhead([20], 8)["tokens"] == 8


def test_cli_on_a_dataset_and_a_lengths_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(0, 100, n)) for n in rng.integers(1, 300, 50)]
    prefix = write_documents(str(tmp_path / "d_text_document"), docs, 100)
    png, js = str(tmp_path / "h.png"), str(tmp_path / "h.json")
    assert main(["--data-path", prefix, "--seq-length", "128", "--cp", "1", "2", "--tp", "1", "--png", png,
                 "--json", js]) == 0
    out = capsys.readouterr().out
    assert "padding overhead at --seq-length 128" in out and "ours, THD per document, cp=2 tp=1" in out
    assert os.path.getsize(png) > 1000
    fig = json.load(open(js))
    assert fig["histogram"]["num_documents"] == 50 and len(fig["padding"]) == 2
    lf = tmp_path / "lengths.txt"
    lf.write_text("\n".join(str(len(d)) for d in docs))
    assert main(["--lengths-file", str(lf), "--seq-length", "128", "--png", png]) == 0
    assert "documents: 50" in capsys.readouterr().out


def test_cli_missing_path_is_one_line(tmp_path, capsys):
    assert main(["--data-path", str(tmp_path / "nope"), "--png", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dataset_stats.py: error: no dataset at")

"""Upstream's other data flags: --data-args-path, --train/valid/test-data-path and
--per-split-data-args-path, read as upstream reads them, on both data paths; the index cache
next to the data when --data-cache-path is not given (megatron-core's default, as upstream)."""
import json
import os

import numpy as np
import pytest

from dcp_ext.data.data_paths import resolve
from dcp_ext.data.documents import build_document_datasets
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import write_documents
from tests.conftest import TINY_MODEL
from tests.support.helpers import drop_flags, run_ranks


def corpus(root, name, n_docs, seed):
    rng = np.random.default_rng(seed)
    docs = [[int(x) for x in rng.integers(0, 254, int(rng.integers(20, 200)))] + [255] for _ in range(n_docs)]
    return write_documents(os.path.join(str(root), f"{name}_text_document"), docs, vocab_size=256)


def test_resolve_reads_upstreams_files(tmp_path):
    args_file, split_file = tmp_path / "data_args.txt", tmp_path / "per_split.json"
    args_file.write_text("0.3 /d/a_text_document\n0.7 /d/b_text_document\n")
    split_file.write_text(json.dumps({"train": "1 /d/a_text_document", "valid": ["/d/v_text_document"], "test": []}))
    assert resolve(None, str(args_file), None, None, None, None) == (
        ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"], None)
    assert resolve(None, None, None, None, None, str(split_file)) == (
        None, [["1", "/d/a_text_document"], ["/d/v_text_document"], None])
    assert resolve(None, None, ["t"], None, ["x"], None) == (None, [["t"], None, ["x"]])
    assert resolve(["p"], None, None, None, None, None) == (["p"], None)


@pytest.mark.parametrize("given, needle", [
    ((["p"], None, ["t"], None, None, None), "--data-path and --train-data-path exclude each other"),
    ((["p"], "f", None, None, None, None), "--data-path and --data-args-path exclude each other"),
    ((None, None, None, ["v"], None, None), "without a train dataset: give --train-data-path"),
    ((None, None, ["1", "t", "x"], None, None, None), "--train-data-path mixes weights and prefixes oddly"),
    ((None, "/nonexistent/args.txt", None, None, None, None), "--data-args-path /nonexistent/args.txt: no such file"),
])
def test_resolve_refuses_in_one_line(given, needle):
    with pytest.raises(DataError, match=needle.replace("(", r"\(")):
        resolve(*given)


def test_per_split_file_must_name_all_three(tmp_path):
    f = tmp_path / "per_split.json"
    f.write_text(json.dumps({"train": ["t"]}))
    with pytest.raises(DataError, match="has no 'valid', 'test'"):
        resolve(None, None, None, None, None, str(f))


def test_document_path_takes_each_split_whole(tmp_path):
    train, valid = corpus(tmp_path, "train", 30, 0), corpus(tmp_path, "valid", 7, 1)
    t, v, test = build_document_datasets(None, "969,30,1", seed=0, max_seq_len=256, eval_iters=1,
                                         per_split=[[train], [valid], None])
    assert (len(t), len(v), test) == (30, 7, None)


@pytest.mark.dist
def test_separate_valid_path_evaluates_on_both_paths(tmp_path):
    """A held-out validation set: the static path (megatron-core's blend_per_split, its index
    cache next to the data) and --dcp each evaluate on it."""
    train, valid = corpus(tmp_path, "train", 60, 0), corpus(tmp_path, "valid", 10, 1)
    flags = drop_flags(TINY_MODEL, "--split", "--eval-iters", "--eval-interval") + [
        "--train-data-path", train, "--valid-data-path", valid, "--eval-iters", "1", "--eval-interval", "1",
        "--train-iters", "1"]
    r = run_ranks(1, flags + ["--micro-batch-size", "2", "--global-batch-size", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss at iteration 1" in r.stdout
    assert os.path.isdir(os.path.join(valid, "cache", "GPTDataset_indices"))  # next to the data, as upstream
    r = run_ranks(1, flags + ["--dcp", "--dcp-global-batch-tokens", "512"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "validation loss at iteration 1" in r.stdout

"""Checks that stop bad input where it can first be seen: token ids as micro-batches
are read, SFT data with nothing to train, ranks on different versions of the data, a data
cache cut short, data preprocessed with another tokenizer, OS errors said as such."""
import errno
import os

import numpy as np
import pytest

from dcp_ext.data.errors import DataError


def _docs(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 250, int(rng.integers(5, 50)))] + [255] for _ in range(n)]


def test_token_past_the_vocabulary_is_caught_where_the_sample_is_read(tmp_path):
    from dcp_ext.data.documents import build_document_datasets
    from dcp_ext.data.indexed import write_documents

    docs = _docs()
    docs[150][3] = 400  # past the first 64 documents that the up-front check reads
    prefix = write_documents(str(tmp_path / "d_text_document"), docs, vocab_size=512)
    os.remove(prefix + ".meta.json")  # no sidecar: the up-front check can only sample
    train, _, _ = build_document_datasets([prefix], "100,0,0", 1, 1024, vocab_size=256)
    bad = [i for i in range(len(train)) if train.source(i)[1] == 150]
    assert len(bad) == 1
    for i in range(len(train)):
        if i != bad[0]:
            train[i]
    with pytest.raises(DataError, match=r"d_text_document.bin document 150 has token id 400, outside"):
        train[bad[0]]


def test_trainable_tokens_of_a_document_range(tmp_path):
    from dcp_ext.data.indexed import IndexedDocuments, write_documents

    docs = _docs(10)
    masks = [[0] * len(d) for d in docs]
    masks[7][-1] = 1
    docs_ = IndexedDocuments(write_documents(str(tmp_path / "s_text_document"), docs, 256, loss_masks=masks))
    assert docs_.has_trainable_tokens() and docs_.has_trainable_tokens(7, 8)
    assert not docs_.has_trainable_tokens(0, 7) and not docs_.has_trainable_tokens(8, 10)
    assert docs_.has_trainable_tokens(0, 10, chunk=3)  # found across chunk boundaries
    plain = IndexedDocuments(write_documents(str(tmp_path / "p_text_document"), docs, 256))
    assert plain.has_trainable_tokens()


def test_tokenizer_mismatch_is_refused_but_null_tokenizer_is_not(tmp_path):
    from dcp_ext.data.indexed import IndexedDocuments, write_documents
    from dcp_ext.data.tokenizers import build_tokenizer

    meta = {"tokenizer": {"class": "GPT2BPETokenizer", "vocab_size": 50257, "eod": 50256}}
    docs = IndexedDocuments(write_documents(str(tmp_path / "g_text_document"), _docs(5), 256, meta=meta))
    with pytest.raises(DataError, match="was preprocessed with GPT2BPETokenizer"):
        docs.check_tokenizer(build_tokenizer("ByteLevelTokenizer"))
    docs.check_tokenizer(build_tokenizer("NullTokenizer", vocab_size=300))  # pre-tokenized data: accepted
    same = {"tokenizer": dict(build_tokenizer("ByteLevelTokenizer").unique_identifiers)}
    ok = IndexedDocuments(write_documents(str(tmp_path / "b_text_document"), _docs(5), 257, meta=same))
    ok.check_tokenizer(build_tokenizer("ByteLevelTokenizer"))


def test_damaged_cache_files_are_found(tmp_path):
    from dcp_ext.data.gpt_dataset import damaged_cache_files

    np.save(tmp_path / "a-sample_index.npy", np.arange(100))
    np.save(tmp_path / "b-shuffle_index.npy", np.arange(100))
    with open(tmp_path / "b-shuffle_index.npy", "r+b") as f:
        f.truncate(90)
    (tmp_path / "c-document_index.npy").write_bytes(b"")
    assert [os.path.basename(p) for p in damaged_cache_files(str(tmp_path))] == ["b-shuffle_index.npy",
                                                                               "c-document_index.npy"]


def _build_on_rank(rank, world, prefixes):
    from dcp_ext.data.documents import build_document_datasets

    try:
        build_document_datasets([prefixes[rank]], "100,0,0", 1, 1024)
        return "ok"
    except DataError as e:
        return str(e)


@pytest.mark.dist
def test_ranks_reading_different_versions_of_the_data_stop(tmp_path):
    from dcp_ext.data.indexed import write_documents
    from tests.support.helpers import run_ranks

    a = write_documents(str(tmp_path / "a" / "c_text_document"), _docs(seed=1), 256)
    b = write_documents(str(tmp_path / "b" / "c_text_document"), _docs(seed=1) + _docs(3, seed=2), 256)
    c = write_documents(str(tmp_path / "c" / "c_text_document"), _docs(seed=1), 256)
    assert run_ranks(2, fn=_build_on_rank, args=([a, c],)) == ["ok", "ok"]  # two copies of the same data
    for line in run_ranks(2, fn=_build_on_rank, args=([a, b],)):  # a stale copy on one node: every rank stops
        assert "rank 1 reads another version of" in line and "every node must see the same data files" in line


def test_os_errors_are_said_as_such(tmp_path):
    from megatron.training.startup.os_errors import explain_failure, explain_os_error

    class Wrapped(BaseException):  # torch.distributed.checkpoint's CheckpointException, in shape
        def __init__(self, failures):
            self.failures = failures

    full = OSError(errno.ENOSPC, "No space left on device", "/ckpt/iter_0000005.incomplete/__0_0.distcp")
    line = explain_os_error(Wrapped({0: (full, None)}))
    assert line.startswith("no space left on the disk writing /ckpt/iter_0000005.incomplete/__0_0.distcp")
    assert "disk" in explain_os_error(RuntimeError("Worker failure: [Errno 28] No space left on device"))
    assert "read-only" in explain_os_error(OSError(errno.EROFS, "Read-only file system", "/x"))
    assert explain_os_error(RuntimeError("shape mismatch")) is None
    assert explain_os_error(ValueError("bad")) is None

    from megatron.training.startup.preflight import OutputPath

    outputs = (OutputPath("--save", str(tmp_path), "dir"),)
    assert explain_failure(RuntimeError("unexpected pos 704 vs 598"), outputs) is None  # this disk is not full


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_data_file_is_said_as_such(tmp_path):
    from dcp_ext.data.indexed import IndexedDocuments, write_documents

    prefix = write_documents(str(tmp_path / "u_text_document"), _docs(5), 256)
    os.chmod(prefix + ".bin", 0)
    try:
        with pytest.raises(DataError, match=r"cannot read .*u_text_document.bin: Permission denied"):
            IndexedDocuments(prefix)
    finally:
        os.chmod(prefix + ".bin", 0o644)

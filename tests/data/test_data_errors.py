"""Bad data gives one DataError line naming the file: missing, corrupt, truncated, vocab, empty."""
import os

import pytest

from dcp_ext.data.documents import build_document_datasets
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import write_documents

DOCS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def build(prefix, **kw):
    return build_document_datasets([prefix], "1", seed=0, max_seq_len=16, **kw)


def expect(prefix, match, path, **kw):
    with pytest.raises(DataError, match=match) as e:
        build(prefix, **kw)
    msg = str(e.value)
    assert "\n" not in msg and path in msg, msg
    return msg


@pytest.fixture
def prefix(tmp_path):
    return write_documents(str(tmp_path / "d_text_document"), DOCS, vocab_size=100)


def test_good_dataset_loads(prefix):
    assert len(build(prefix, vocab_size=100)[0]) == 3


def test_missing_path(tmp_path):
    p = str(tmp_path / "nope" / "x_text_document")
    expect(p, "no dataset at", p)


def test_missing_idx_or_bin(prefix):
    os.remove(prefix + ".bin")
    expect(prefix, r"\.bin not found", prefix + ".bin")


def test_corrupt_idx_header(prefix):
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    expect(prefix, "not a Megatron index file", prefix + ".idx")


def test_truncated_idx(prefix):
    data = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(data[:-5])
    expect(prefix, "is truncated", prefix + ".idx")
    open(prefix + ".idx", "wb").write(data[:20])
    expect(prefix, "is truncated", prefix + ".idx")


def test_corrupt_offsets(prefix):
    data = bytearray(open(prefix + ".idx", "rb").read())
    n = 3
    data[34 + 4 * n + 8] ^= 0x40  # second sequence pointer
    open(prefix + ".idx", "wb").write(bytes(data))
    expect(prefix, "offsets do not follow", prefix + ".idx")


def test_truncated_and_oversized_bin(prefix):
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-2])
    expect(prefix, "is truncated", prefix + ".bin")
    open(prefix + ".bin", "wb").write(data + b"xx")
    expect(prefix, "is corrupt", prefix + ".bin")


def test_vocabulary_mismatch_from_meta_and_from_first_documents(prefix):
    msg = expect(prefix, "vocabulary mismatch", prefix, vocab_size=9)
    assert "token id 9" in msg
    os.remove(prefix + ".meta.json")  # a dataset preprocessed elsewhere: checked on its first documents
    expect(prefix, "vocabulary mismatch.*first 3 documents", prefix, vocab_size=8)
    assert len(build(prefix, vocab_size=10)[0]) == 3


def test_empty_dataset(tmp_path):
    p = write_documents(str(tmp_path / "empty_text_document"), [], vocab_size=100)
    expect(p, "is empty", p)


def test_loss_mask_that_does_not_match(tmp_path):
    p = write_documents(str(tmp_path / "s"), DOCS, 100, loss_masks=[[1] * len(d) for d in DOCS])
    write_documents(p + "_loss_mask", [[1, 1]], 100)
    expect(p, "does not match", p + "_loss_mask.idx")


def test_fixed_length_path_checks_the_same(prefix):
    from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
    from dcp_ext.data.tokenizers import build_tokenizer

    with open(prefix + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    with pytest.raises(DataError, match="not a Megatron index file"):
        build_fixed_length_datasets([prefix], "1", 4, 0, build_tokenizer("ByteLevelTokenizer"), (10, 0, 0),
                                    cache_dir=os.path.dirname(prefix) + "/cache")

"""Documents as samples: lengths from the .idx, truncation/splitting, splits, blends, epochs, resume."""
import numpy as np
import pytest

from dcp_ext.planning.batching import global_batches
from dcp_ext.data.batches import ArrayLengths, GlobalBatchStream
from dcp_ext.data.documents import build_document_datasets, parse_blend, split_bookends
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import IndexedDocuments, write_documents

V = 1000


def corpus(tmp_path, name, lengths, start=0):
    """Document k is [start+k, 1, 2, ...] (first token identifies it) of the given length."""
    docs = [[(start + k) % V] + list(np.arange(1, n) % V) for k, n in enumerate(lengths)]
    return write_documents(str(tmp_path / name), docs, V), docs


def test_lengths_come_from_the_idx_alone(tmp_path, monkeypatch):
    prefix, docs = corpus(tmp_path, "a", [5, 1, 9, 3])

    def no_bin(*a, **k):
        raise AssertionError("the .bin was opened")

    monkeypatch.setattr(IndexedDocuments, "_open", no_bin)
    train, _, _ = build_document_datasets([prefix], "1", seed=0, max_seq_len=4)
    assert sorted(train.lengths.tolist()) == [1, 3, 4, 4]
    assert train.sample_lengths(0, 8).tolist() == train.lengths.tolist() + train.sample_lengths(4, 8).tolist()


def test_truncation_and_items(tmp_path):
    prefix, docs = corpus(tmp_path, "a", [5, 1, 9, 3])
    train, _, _ = build_document_datasets([prefix], "1", seed=0, max_seq_len=4)
    for i in range(len(train)):
        _, d, off = train.source(i)
        assert off == 0 and train[i].tolist() == docs[d][:4] and len(train[i]) == train.lengths[i]


def test_split_long_documents_overlap_by_one(tmp_path):
    prefix, docs = corpus(tmp_path, "a", [10, 3, 4])
    train, _, _ = build_document_datasets([prefix], "1", seed=0, max_seq_len=4, split_long_documents=True)
    chunks = sorted((train.source(i)[1:], train[i].tolist()) for i in range(len(train)))
    doc0 = [c for (d, _), c in chunks if d == 0]
    assert doc0 == [docs[0][0:4], docs[0][3:7], docs[0][6:10]]  # each next-token pair once
    assert [c for (d, _), c in chunks if d == 2] == [docs[2]]
    assert max(train.lengths) == 4


def test_splits_are_contiguous_ranges_and_deterministic(tmp_path):
    prefix, _ = corpus(tmp_path, "a", [3] * 100)
    a = build_document_datasets([prefix], "80,15,5", seed=7, max_seq_len=8)
    b = build_document_datasets([prefix], "80,15,5", seed=7, max_seq_len=8)
    firsts = [sorted(int(ds[i][0]) for i in range(len(ds))) for ds in a]
    assert firsts == [list(range(0, 80)), list(range(80, 95)), list(range(95, 100))]
    for x, y in zip(a, b):
        assert [x[i].tolist() for i in range(len(x))] == [y[i].tolist() for i in range(len(y))]
    c = build_document_datasets([prefix], "80,15,5", seed=8, max_seq_len=8)[0]
    assert [int(c[i][0]) for i in range(80)] != [int(a[0][i][0]) for i in range(80)]


def test_epochs_reshuffle_and_cover_everything(tmp_path):
    prefix, _ = corpus(tmp_path, "a", [2] * 20)
    train = build_document_datasets([prefix], "1", seed=1, max_seq_len=8)[0]
    e0 = [int(train[i][0]) for i in range(20)]
    e1 = [int(train[i][0]) for i in range(20, 40)]
    assert sorted(e0) == sorted(e1) == list(range(20)) and e0 != e1


def test_blend_weights_and_determinism(tmp_path):
    pa, _ = corpus(tmp_path, "a", [2] * 50, start=0)
    pb, _ = corpus(tmp_path, "b", [3] * 50, start=500)
    blend = ["0.25", pa, "0.75", pb]
    assert parse_blend(blend) == ([pa, pb], [0.25, 0.75])
    t1 = build_document_datasets(blend, "1", seed=5, max_seq_len=8)[0]
    t2 = build_document_datasets(blend, "1", seed=5, max_seq_len=8)[0]
    ids = [int(t1[i][0]) for i in range(400)]  # past one epoch of either component
    assert ids == [int(t2[i][0]) for i in range(400)]
    frac_b = np.mean([x >= 500 for x in ids])
    assert abs(frac_b - 0.75) < 0.01
    assert t1.sample_lengths(0, 400).tolist() == [3 if x >= 500 else 2 for x in ids]


def test_unweighted_blend_follows_sizes(tmp_path):
    pa, _ = corpus(tmp_path, "a", [2] * 30)
    pb, _ = corpus(tmp_path, "b", [3] * 10, start=500)
    train = build_document_datasets([pa, pb], "1", seed=5, max_seq_len=8)[0]
    assert len(train) == 40 and sorted(train.lengths.tolist()) == [2] * 30 + [3] * 10


def test_stream_follows_the_global_batch_rule_across_epochs(tmp_path):
    rng = np.random.default_rng(0)
    prefix, _ = corpus(tmp_path, "a", rng.integers(1, 60, size=37).tolist())
    train = build_document_datasets([prefix], "1", seed=2, max_seq_len=32)[0]
    stream = GlobalBatchStream(train, global_batch_tokens=100, max_seq_len=32)
    batches = [stream.next() for _ in range(30)]  # several epochs
    n = batches[-1].sample_ids[-1] + 1
    want = global_batches(train.sample_lengths(0, n + 200), 100, 32, count=30)
    assert [b.sample_ids for b in batches] == want
    for b in batches:
        assert b.lengths == train.lengths_of(b.sample_ids).tolist() and b.num_tokens <= 100 or len(b.lengths) == 1
    assert stream.consumed_samples == n


def test_resume_at_consumed_samples_is_exact(tmp_path):
    rng = np.random.default_rng(1)
    prefix, _ = corpus(tmp_path, "a", rng.integers(1, 80, size=50).tolist())
    train = build_document_datasets([prefix], "1", seed=2, max_seq_len=64)[0]
    full = GlobalBatchStream(train, 200, 64)
    ref = [full.next() for _ in range(12)]
    part = GlobalBatchStream(train, 200, 64)
    for _ in range(5):
        part.next()
    resumed = GlobalBatchStream(train, 200, 64, consumed_samples=part.state_dict()["consumed_samples"])
    assert [resumed.next() for _ in range(7)] == ref[5:]


def test_peek_is_lookahead_without_consuming():
    lengths = [5, 60, 7, 7, 7, 100, 3, 3, 1]
    s = GlobalBatchStream(ArrayLengths(lengths), global_batch_tokens=64, max_seq_len=50)
    ahead = s.peek(3)
    assert [b.sample_ids for b in ahead] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [b.lengths for b in ahead] == [[5, 50, 7], [7, 7, 50], [3, 3, 1]]  # 60 and 100 truncated to 50
    assert s.consumed_samples == 0 and s.next() == ahead[0] and s.consumed_samples == 3
    assert [b.sample_ids for b in s] == [[3, 4, 5], [6, 7, 8]]  # a limited stream ends


def test_stream_window_growth_is_exact():
    lengths = np.ones(5000, dtype=np.int64)
    s = GlobalBatchStream(ArrayLengths(lengths), global_batch_tokens=3000, max_seq_len=10)
    assert [len(b.sample_ids) for b in s] == [3000, 2000]


def test_sft_loss_mask_follows_the_sample(tmp_path):
    docs = [[1, 2, 3, 4, 5], [6, 7, 8]]
    masks = [[0, 0, 1, 1, 1], [0, 1, 1]]
    prefix = write_documents(str(tmp_path / "s"), docs, V, loss_masks=masks)
    train = build_document_datasets([prefix], "1", seed=0, max_seq_len=4, split_long_documents=True)[0]
    assert train.has_loss_mask
    for i in range(len(train)):
        _, d, off = train.source(i)
        n = len(train[i])
        assert train[i].tolist() == docs[d][off:off + n] and train.loss_mask(i).tolist() == masks[d][off:off + n]


@pytest.mark.parametrize("split", ["", "1,2,3,4", "a,b", "0,0,0", "-1,2"])
def test_bad_split_strings(split):
    with pytest.raises(DataError, match="bad --split"):
        split_bookends(split)


def test_empty_train_split_is_an_error(tmp_path):
    prefix, _ = corpus(tmp_path, "a", [3, 3])
    with pytest.raises(DataError, match="train split of .* is empty"):
        build_document_datasets([prefix], "1,1000,0", seed=0, max_seq_len=8)

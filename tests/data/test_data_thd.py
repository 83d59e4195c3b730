"""THD micro-batches: labels, positions and loss masks at document edges; padding rules; SFT."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ext.data.thd import build_micro_batch, materialize, padded_lengths

EOD = 99


def test_two_documents_no_padding():
    b = build_micro_batch([[10, 11, 12], [20, 21]])
    assert b.tokens.tolist() == [10, 11, 12, 20, 21]
    assert b.labels.tolist() == [11, 12, 0, 21, 0]
    assert b.loss_mask.tolist() == [1, 1, 0, 1, 0]  # the last position of a document predicts nothing
    assert b.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert b.cu_seqlens.tolist() == b.cu_seqlens_padded.tolist() == [0, 3, 5]
    assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
    assert b.loss_mask.dtype == torch.float32 and b.tokens.dtype == torch.int64
    assert (b.max_seqlen, b.num_loss_tokens, b.num_tokens) == (3, 3, 5)


def test_single_token_document_has_no_loss():
    b = build_micro_batch([[7], [1, 2]])
    assert b.loss_mask.tolist() == [0, 1, 0] and b.position_ids.tolist() == [0, 0, 1]


def test_pad_each_to_cp():
    b = build_micro_batch([[1, 2, 3], [4, 5, 6, 7, 8]], pad_each_to=4, pad_id=0)
    assert b.cu_seqlens.tolist() == [0, 3, 8]
    assert b.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert b.tokens.tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0]
    assert b.labels.tolist() == [2, 3, 0, 0, 5, 6, 7, 8, 0, 0, 0, 0]
    assert b.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1, 2]
    assert b.max_seqlen == 8


def test_pad_total_extends_the_last_document():
    # each to 4 (cp=2), total to 6 (tp=6 with SP): 4 + 4 = 8 -> 12 = lcm multiple
    b = build_micro_batch([[1, 2, 3], [4, 5]], pad_each_to=4, pad_total_to=6)
    assert b.cu_seqlens_padded.tolist() == [0, 4, 12] and b.num_tokens == 12
    assert b.loss_mask[4:].tolist() == [1, 0] + [0] * 6
    assert padded_lengths([3, 2], 1, 4) == [3, 5]


def test_eod_mask_loss_masks_eod_inputs():
    b = build_micro_batch([[1, 2, EOD], [3, EOD, 4, 5]], eod_mask_loss=True, eod=EOD)
    # input EOD at positions 2 and 4 get 0 (position 2 is also a document end)
    assert b.loss_mask.tolist() == [1, 1, 0, 1, 0, 1, 0]
    b2 = build_micro_batch([[1, 2, EOD], [3, EOD, 4, 5]])
    assert b2.loss_mask.tolist() == [1, 1, 0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="eod"):
        build_micro_batch([[1]], eod_mask_loss=True)


def test_sft_mask_applies_to_labels():
    # prompt 1 2 | response 3 4 EOD: positions predicting 3, 4, EOD count
    b = build_micro_batch([[1, 2, 3, 4, EOD], [5, 6]], [[0, 0, 1, 1, 1], None], pad_each_to=2)
    assert b.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 1, 0]
    assert b.num_loss_tokens == 4


def test_errors():
    with pytest.raises(ValueError):
        build_micro_batch([])
    with pytest.raises(ValueError):
        build_micro_batch([[]])
    with pytest.raises(ValueError):
        build_micro_batch([[1, 2]], [[1]])


class FakeDataset:
    has_loss_mask = True

    def __init__(self):
        self.docs = {3: np.array([1, 2, 3]), 8: np.array([4, 5])}

    def __getitem__(self, i):
        return self.docs[i]

    def loss_mask(self, i):
        return np.ones(len(self.docs[i]), dtype=np.uint8)


def test_materialize_keeps_plan_order():
    b = materialize(FakeDataset(), [8, 3], pad_each_to=2)
    assert b.tokens.tolist() == [4, 5, 1, 2, 3, 0] and b.cu_seqlens.tolist() == [0, 2, 5]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2, 3, 4, 8]))
def test_invariants(lengths, each, total):
    rng = np.random.default_rng(sum(lengths))
    docs = [rng.integers(0, 50, n) for n in lengths]
    b = build_micro_batch(docs, pad_each_to=each, pad_total_to=total)
    cup = b.cu_seqlens_padded.numpy()
    assert cup[-1] == b.num_tokens and b.num_tokens % total == 0 and np.all(np.diff(cup) % each == 0)
    assert b.num_loss_tokens == sum(n - 1 for n in lengths)
    for k, d in enumerate(docs):
        s = cup[k]
        n = len(d)
        assert b.tokens[s:s + n].tolist() == d.tolist()
        assert b.labels[s:s + n - 1].tolist() == d[1:].tolist()
        assert b.position_ids[s:s + n].tolist() == list(range(n))
        assert b.loss_mask[s + n - 1:cup[k + 1]].sum() == 0
    assert int(b.position_ids.max()) < max(b.max_seqlen, 1)


class LengthsDataset(FakeDataset):
    has_loss_mask = False

    def lengths_of(self, ids):
        return np.array([len(self.docs[i]) for i in ids])


def test_num_loss_tokens_matches_the_packed_batches():
    from dcp_ext.data.thd import num_loss_tokens

    ds = FakeDataset()
    ds.docs = {0: np.array([1, 2, EOD, 3]), 1: np.array([EOD, 5])}
    ds.loss_mask = lambda i: np.array([0, 1, 1, 1]) if i == 0 else np.array([1, 1])
    for eod_mask in (False, True):
        packed = materialize(ds, [0, 1], eod_mask_loss=eod_mask, eod=EOD, pad_each_to=4)
        assert num_loss_tokens(ds, [0, 1], eod_mask_loss=eod_mask, eod=EOD) == packed.num_loss_tokens
    plain = LengthsDataset()
    assert num_loss_tokens(plain, [3, 8]) == materialize(plain, [3, 8]).num_loss_tokens == 3

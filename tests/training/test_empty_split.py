"""A split that --split gives a share but no document is one line before training, on both
data paths (megatron-core would otherwise wait for ever on it), with megatron-core's rounding."""
import numpy as np
import pytest

from dcp_ext.data.documents import build_document_datasets, split_bookends, split_range
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import write_documents


@pytest.fixture
def twenty_docs(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[int(x) for x in rng.integers(0, 254, int(rng.integers(20, 60)))] + [255] for _ in range(20)]
    return write_documents(str(tmp_path / "tiny_text_document"), docs, vocab_size=256)


def test_ranges_round_as_megatron_core():
    # 500 documents, the default split: megatron-core cuts [0, 484) [484, 500) [500, 500)
    assert [split_range(b, 500) for b in split_bookends("969,30,1")] == [(0, 484), (484, 500), (500, 500)]


def test_document_path_refuses_an_evaluated_empty_split(twenty_docs):
    with pytest.raises(DataError, match=r"the test split of .* gets 0 documents of its 20 with --split 969,30,1, "
                                        r"and --eval-iters 1 evaluates it"):
        build_document_datasets([twenty_docs], "969,30,1", seed=0, max_seq_len=64, eval_iters=1)
    train, valid, test = build_document_datasets([twenty_docs], "969,30,1", seed=0, max_seq_len=64, eval_iters=0)
    assert len(train) == 19 and len(valid) == 1 and test is None  # nothing evaluates it: no refusal


def test_fixed_length_path_refuses_an_evaluated_empty_split(twenty_docs):
    from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
    from dcp_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=255)
    with pytest.raises(DataError, match=r"the test split of .* gets 0 documents of its 20 with --split 969,30,1"):
        build_fixed_length_datasets([twenty_docs], "969,30,1", 32, 0, tokenizer, (8, 4, 4), "/nonexistent",
                                    eval_iters=1)

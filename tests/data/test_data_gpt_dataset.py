"""Upstream Megatron's fixed-length path (megatron.core GPTDataset) on our files and tokenizers."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
from dcp_ext.data.indexed import write_documents
from dcp_ext.data.tokenizers import build_tokenizer

TOK = build_tokenizer("ByteLevelTokenizer")


def corpus(tmp_path, name, n_docs, base):
    rng = np.random.default_rng(base)
    docs = [list(rng.integers(base, base + 50, rng.integers(3, 30))) + [TOK.eod] for _ in range(n_docs)]
    return write_documents(str(tmp_path / name), docs, TOK.vocab_size), docs


def items(ds, n):
    return [{k: v.clone() for k, v in ds[i].items() if torch.is_tensor(v)} for i in range(n)]


def test_single_prefix_items_are_gpt_samples(tmp_path):
    prefix, docs = corpus(tmp_path, "a", 60, 0)
    train, valid, test = build_fixed_length_datasets([prefix], "90,10,0", 16, 1234, TOK, (40, 4, 0),
                                                     cache_dir=str(tmp_path / "cache"))
    assert test is None and len(train) >= 40 and len(valid) >= 4
    whole = {tuple(int(t) for t in d) for d in docs}
    s = train[0]
    assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert all(v.shape == (16,) for v in s.values())
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])
    assert s["position_ids"].tolist() == list(range(16)) and s["loss_mask"].sum() == 16
    for i in range(len(train)):  # samples are shuffled documents, concatenated: whole ones are real
        joined = torch.cat([train[i]["tokens"], train[i]["labels"][-1:]]).tolist()
        ends = [j for j, t in enumerate(joined) if t == TOK.eod]
        for a, b in zip(ends, ends[1:]):
            assert tuple(joined[a + 1:b + 1]) in whole
    again = build_fixed_length_datasets([prefix], "90,10,0", 16, 1234, TOK, (40, 4, 0),
                                        cache_dir=str(tmp_path / "cache2"))[0]
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(items(train, 10), items(again, 10)))


def test_megatron_reset_and_eod_mask_flags(tmp_path):
    prefix, _ = corpus(tmp_path, "a", 30, 0)
    train = build_fixed_length_datasets([prefix], "1", 32, 1, TOK, (10, 0, 0), cache_dir=str(tmp_path / "c"),
                                        reset_position_ids=True, eod_mask_loss=True)[0]
    for i in range(5):
        s = train[i]
        eod_at = (s["tokens"] == TOK.eod).nonzero().flatten().tolist()
        assert all(s["loss_mask"][j] == 0 for j in eod_at)
        for j in eod_at:
            if j + 1 < 32:
                assert s["position_ids"][j + 1] == 0


def test_blend_without_and_with_torch_distributed(tmp_path):
    pa, _ = corpus(tmp_path, "a", 40, 0)
    pb, _ = corpus(tmp_path, "b", 40, 100)
    blend = ["0.3", pa, "0.7", pb]
    assert not dist.is_initialized()
    train = build_fixed_length_datasets(blend, "1", 8, 3, TOK, (50, 0, 0), cache_dir=str(tmp_path / "c"))[0]
    assert not dist.is_initialized()  # the private one-rank group is gone again
    assert len(train) == 50
    from_b = sum(int(train[i]["tokens"][0] >= 100 and train[i]["tokens"][0] != TOK.eod) for i in range(50))
    assert 25 <= from_b <= 45
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        again = build_fixed_length_datasets(blend, "1", 8, 3, TOK, (50, 0, 0), cache_dir=str(tmp_path / "c"))[0]
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(items(train, 50), items(again, 50)))

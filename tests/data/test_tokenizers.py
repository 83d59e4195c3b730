"""Tokenizers: round trips, EOD ids, Megatron's vocab padding, one-line errors."""
import json

import pytest

from dcp_ext.data.errors import DataError
from dcp_ext.data.gpt2_bpe import bytes_to_unicode
from dcp_ext.data.tokenizers import build_tokenizer, padded_vocab_size


def make_gpt2_files(tmp_path):
    """A tiny GPT-2 vocabulary: the 256 byte symbols plus a few merges."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(sorted(b2u))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
              ("Ġwor", "l")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vf, mf = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vf.write_text(json.dumps(vocab))
    mf.write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    return str(vf), str(mf), vocab


def test_byte_level_round_trip_and_eod():
    tok = build_tokenizer("ByteLevelTokenizer")
    text = "héllo\n\tworld ✓ \x00"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text
    assert (tok.vocab_size, tok.eod) == (257, 256)


def test_null_tokenizer_is_megatrons():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    assert (tok.vocab_size, tok.eod) == (101, 100)
    with pytest.raises(DataError, match="vocab-size"):
        build_tokenizer("NullTokenizer")


def test_gpt2_bpe_merges_by_rank(tmp_path):
    vf, mf, vocab = make_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vf, merge_file=mf)
    assert tok.tokenize("hello world") == [vocab["hello"], vocab["Ġworl"], vocab["d"]]
    assert tok.eod == vocab["<|endoftext|>"] and tok.vocab_size == len(vocab)
    for text in ["hello world", "héllo, wörld! 123  \n\n  x's", "✓ emoji 🙂 tabs\t"]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_missing_files_are_one_line(tmp_path):
    with pytest.raises(DataError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file="x")
    with pytest.raises(DataError, match="not found: .*nope.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"), merge_file="x")


def test_unknown_tokenizer_and_missing_hf_path(tmp_path):
    with pytest.raises(DataError, match="unknown --tokenizer-type 'Bogus'") as e:
        build_tokenizer("Bogus")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="not found"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))


@pytest.mark.parametrize("vocab,div,tp,want", [(50257, 128, 1, 50304), (50257, 128, 2, 50432),
                                               (257, 128, 1, 384), (256, 128, 1, 256), (32000, 64, 8, 32256)])
def test_padded_vocab_size_matches_megatron(vocab, div, tp, want):
    assert padded_vocab_size(vocab, div, tp) == want


def test_huggingface_wrapper_stays_local(tmp_path, monkeypatch):
    """transformers is not a dependency: a stand-in module checks what the wrapper asks of it."""
    import sys
    import types

    seen = {}

    class FakeHF:
        eos_token_id = 2

        def __len__(self):
            return 10

        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [3 + (ord(c) % 7) for c in text]

        def decode(self, ids):
            return "<%d>" % len(ids)

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path, local_files_only):
            seen.update(path=path, local=local_files_only)
            return FakeHF()

    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = AutoTokenizer
    monkeypatch.setitem(sys.modules, "transformers", fake)
    (tmp_path / "tok").mkdir()
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    assert seen == {"path": str(tmp_path / "tok"), "local": True}
    assert (tok.vocab_size, tok.eod) == (10, 2) and tok.tokenize("ab") == [3 + 97 % 7, 3 + 98 % 7]
    assert tok.unique_identifiers["class"] == "HuggingFaceTokenizer"

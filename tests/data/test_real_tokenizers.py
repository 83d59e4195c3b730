"""The HuggingFace and SentencePiece tokenizer types against the real libraries.

test_tokenizers.py checks the wrappers with stand-ins; here tiny tokenizers are trained
with `tokenizers` and `sentencepiece` themselves, documents go through
tools/preprocess_data.py's pipeline (2 workers), and the .bin/.idx must hold exactly the
ids the library gives, plus its end-of-sequence id, and decode back as the library does.
"""
import json

import pytest

from dcp_ext.data.indexed import IndexedDocuments
from dcp_ext.data.preprocess import build_parser, run
from dcp_ext.data.tokenizers import build_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "hello world", "héllo wörld ✓ ünïcode",
         "for i in range(10):\n    print(i * i)\n", "", "x = [1, 2, 3]"]
CORPUS = TEXTS * 20 + [f"value_{i} = {i} * {i + 1}  # line {i}" for i in range(200)]


def preprocess(tmp_path, *flags):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = build_parser().parse_args(["--input", str(src), "--output-prefix", str(tmp_path / "out"),
                                      "--no-progress", "--append-eod", "--workers", "2", *flags])
    return IndexedDocuments(run(args)["text"])


@pytest.mark.dist
def test_huggingface_tokenizer_json_matches_the_library(tmp_path):
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    docs = preprocess(tmp_path, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "hf"))
    eos = tok.token_to_id("<|endoftext|>")
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    assert ours.eod == eos and ours.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    kept = [t for t in TEXTS if t]
    assert len(docs) == len(kept)
    for i, text in enumerate(kept):
        want = tok.encode(text, add_special_tokens=False).ids
        assert docs.tokens(i).tolist() == want + [eos]
        assert ours.detokenize(docs.tokens(i)[:-1]) == tok.decode(want) == text  # byte-level: lossless


@pytest.mark.dist
@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_model_matches_the_library(tmp_path, tokenizer_type):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(line for t in CORPUS for line in t.splitlines() if line) + "\n")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                   normalization_rule_name="identity", minloglevel=2)
    model = str(tmp_path / "sp.model")
    docs = preprocess(tmp_path, "--tokenizer-type", tokenizer_type, "--tokenizer-model", model)
    sp = spm.SentencePieceProcessor(model_file=model)
    ours = build_tokenizer(tokenizer_type, tokenizer_model=model)
    assert ours.eod == sp.eos_id() >= 0 and ours.vocab_size == sp.vocab_size()
    kept = [t for t in TEXTS if t]
    assert len(docs) == len(kept)
    for i, text in enumerate(kept):
        want = sp.encode(text)
        assert docs.tokens(i).tolist() == want + [sp.eos_id()]
        assert ours.detokenize(docs.tokens(i)[:-1]) == sp.decode(want)

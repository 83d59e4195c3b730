"""tools/preprocess_data.py: JSONL -> .bin/.idx -> samples reproduces token ids; SFT masks; errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dcp_ext.data.documents import build_document_datasets
from dcp_ext.data.errors import DataError
from dcp_ext.data.indexed import IndexedDocuments
from dcp_ext.data.preprocess import build_parser, main, run
from dcp_ext.data.tokenizers import build_tokenizer

from test_tokenizers import make_gpt2_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["hello world", "", "héllo\nwörld ✓", "a" * 300, "hello hello world world", "x"]


def write_jsonl(path, objs):
    with open(path, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
    return str(path)


def preprocess(tmp_path, *flags, objs=None, name="c"):
    src = write_jsonl(tmp_path / f"{name}.jsonl", objs if objs is not None else [{"text": t} for t in TEXTS])
    args = build_parser().parse_args(["--input", src, "--output-prefix", str(tmp_path / name), "--no-progress",
                                      *flags])
    return run(args)


@pytest.mark.parametrize("flags,tok_kwargs", [
    (["--tokenizer-type", "ByteLevelTokenizer"], dict(tokenizer_type="ByteLevelTokenizer")),
    (["--tokenizer-type", "GPT2BPETokenizer"], "gpt2"),
])
@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.dist)])
def test_round_trip(tmp_path, flags, tok_kwargs, workers):
    if tok_kwargs == "gpt2":
        vf, mf, _ = make_gpt2_files(tmp_path)
        flags = flags + ["--vocab-file", vf, "--merge-file", mf]
        tok_kwargs = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vf, merge_file=mf)
    out = preprocess(tmp_path, *flags, "--append-eod", "--workers", workers)
    tok = build_tokenizer(**tok_kwargs)
    docs = IndexedDocuments(out["text"])
    want = [tok.tokenize(t) + [tok.eod] for t in TEXTS if t]  # empty documents are skipped
    assert len(docs) == len(want)
    for i, ids in enumerate(want):
        assert docs.tokens(i).tolist() == ids
        assert tok.detokenize(docs.tokens(i)[:-1]) == [t for t in TEXTS if t][i]
    assert docs.meta["max_token_id"] == max(max(w) for w in want)


def test_null_tokenizer_and_several_keys(tmp_path):
    objs = [{"text": "1 2 3", "title": "7"}, {"text": "4 5", "title": "8 9"}]
    out = preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                     "--json-keys", "text", "title", objs=objs)
    assert sorted(out) == ["text", "title"] and out["title"].endswith("c_title_document")
    text, title = IndexedDocuments(out["text"]), IndexedDocuments(out["title"])
    assert [text.tokens(i).tolist() for i in range(2)] == [[1, 2, 3], [4, 5]]
    assert [title.tokens(i).tolist() for i in range(2)] == [[7], [8, 9]]


def test_samples_reproduce_ids_through_the_document_dataset(tmp_path):
    out = preprocess(tmp_path, "--tokenizer-type", "ByteLevelTokenizer")
    train, valid, test = build_document_datasets([out["text"]], "1,0,0", seed=3, max_seq_len=10_000)
    assert valid is None and test is None
    got = sorted(bytes(train[i].tolist()).decode() for i in range(len(train)))
    assert got == sorted(t for t in TEXTS if t)


def test_sft_prompt_response_masks_the_response(tmp_path):
    objs = [{"prompt": "Q: 2+2?\n", "response": "A: 4"}, {"prompt": "hi ", "response": "yo"}]
    out = preprocess(tmp_path, "--tokenizer-type", "ByteLevelTokenizer", "--sft", objs=objs)
    docs = IndexedDocuments(out["sft"])
    assert out["sft"].endswith("c_sft_document") and docs.has_loss_mask
    for i, o in enumerate(objs):
        p, r = o["prompt"].encode(), o["response"].encode()
        assert docs.tokens(i).tolist() == list(p) + list(r) + [256]
        assert docs.loss_mask(i).tolist() == [0] * len(p) + [1] * (len(r) + 1)


def test_sft_chat_messages(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ok"}]
    out = preprocess(tmp_path, "--tokenizer-type", "ByteLevelTokenizer", "--sft", objs=[{"messages": msgs}])
    docs = IndexedDocuments(out["sft"])
    toks, mask = docs.tokens(0).tolist(), docs.loss_mask(0).tolist()
    trained = bytes(t for t, m in zip(toks, mask) if m and t < 256).decode()
    assert trained == "hello\nok\n" and toks[-1] == 256 and mask[-1] == 1
    assert bytes(t for t in toks if t < 256).decode() == \
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello\n<|user|>\nbye\n<|assistant|>\nok\n"


def test_sft_without_assistant_is_an_error(tmp_path):
    with pytest.raises(DataError, match="line 1 of .*: no assistant message"):
        preprocess(tmp_path, "--tokenizer-type", "ByteLevelTokenizer", "--sft",
                   objs=[{"messages": [{"role": "user", "content": "x"}]}])


def test_bad_json_names_line_and_file_and_leaves_nothing(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n\n{"text": "oops}\n')
    rc = main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
               "ByteLevelTokenizer", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("preprocess_data.py: error: line 3 of ") and "bad.jsonl: bad JSON" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # no partial dataset


@pytest.mark.parametrize("objs,match", [([{"body": "x"}], "line 1 of .*: no key 'text'"),
                                        ([{"text": 3}], "key 'text' is not a string"),
                                        ([{"text": "1 99"}], "token id 99 outside the vocabulary of 11")])
def test_bad_records(tmp_path, objs, match):
    with pytest.raises(DataError, match=match):
        preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", objs=objs)


@pytest.mark.dist
def test_cli_errors_are_one_line_and_nonzero(tmp_path):
    cases = [(["--input", str(tmp_path / "missing.jsonl"), "--tokenizer-type", "ByteLevelTokenizer"],
              "--input not found: " + str(tmp_path / "missing.jsonl")),
             (["--input", write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}]), "--tokenizer-type", "Nope"],
              "unknown --tokenizer-type 'Nope'")]
    for flags, msg in cases:
        r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *flags,
                            "--output-prefix", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if "warn" not in ln.lower()]
        assert r.returncode == 1, r.stderr
        assert lines == [f"preprocess_data.py: error: {lines[0].split('error: ', 1)[1]}"] and msg in lines[0]

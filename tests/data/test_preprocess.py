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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# ---- upstream's empty documents, list-valued fields and --partitions --------------------------

def _index(prefix):
    from dcp_ext.data.indexed import megatron_indexed

    ds = megatron_indexed().IndexedDataset(prefix, multimodal=False, mmap=True)
    return ds.document_indices.tolist(), ds.sequence_lengths.tolist()


def test_empty_documents_are_kept_as_upstream_keeps_them(tmp_path):
    """Upstream's add_document(ids, []) for an empty field: a document with no sequence, so
    the datasets of several keys line up document for document (row i = line i)."""
    objs = [{"text": "1 2", "title": ""}, {"text": "", "title": "3"}, {"text": "4", "title": "5 6"}]
    out = preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod",
                     "--json-keys", "text", "title", objs=objs)
    assert _index(out["text"]) == ([0, 1, 1, 2], [3, 2])  # 3 documents; the empty one has no sequence
    assert _index(out["title"]) == ([0, 0, 1, 2], [2, 3])
    assert IndexedDocuments(out["text"]).meta["num_documents"] == 3


def test_list_valued_field_is_one_document_of_several_sequences(tmp_path):
    objs = [{"text": ["1 2", "", "3"]}, {"text": "4"}]
    out = preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod", objs=objs)
    assert _index(out["text"]) == ([0, 2, 3], [2, 2, 2])  # the EOD (10) ends the document's last sequence
    docs = IndexedDocuments(out["text"])
    assert [docs.tokens(i).tolist() for i in range(3)] == [[1, 2], [3, 10], [4, 10]]
    with pytest.raises(DataError, match="key 'text' is not a string or a list of strings"):
        preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", objs=[{"text": ["1", 2]}],
                   name="bad")


def test_zero_length_sequences_never_reach_a_dcp_batch(tmp_path):
    """A dataset another tool wrote with 0-token sequences: the --dcp stream skips them (the
    static path's GPTDataset handles them itself)."""
    from dcp_ext.data.indexed import megatron_indexed

    mi = megatron_indexed()
    prefix = str(tmp_path / "z_text_document")
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=mi.DType.optimal_dtype(256))
    for doc in ([1, 2, 255], [], [3, 255], [], [4, 5, 6, 255]):
        builder.add_document(np.asarray(doc, dtype=np.int64), [len(doc)])
    builder.finalize(prefix + ".idx")
    train, _, _ = build_document_datasets([prefix], "1", seed=0, max_seq_len=64)
    assert len(train) == 3 and sorted(train.sample_lengths(0, 3).tolist()) == [2, 3, 4]


@pytest.mark.dist
def test_partitions_give_the_same_bytes(tmp_path):
    objs = [{"text": t, "title": t[::-1]} for t in TEXTS * 3] + [{"text": ["ab", "", "cd"], "title": ""}]
    flags = ["--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--json-keys", "text", "title"]
    one = preprocess(tmp_path, *flags, objs=objs, name="one")
    src = str(tmp_path / "one.jsonl")
    many = run(build_parser().parse_args(["--input", src, "--output-prefix", str(tmp_path / "many"), "--no-progress",
                                          "--partitions", "4", "--workers", "4", *flags]))
    for key in ("text", "title"):
        for ext in (".bin", ".idx", ".meta.json"):
            assert open(one[key] + ext, "rb").read() == open(many[key] + ext, "rb").read(), (key, ext)
    assert not [n for n in os.listdir(tmp_path) if "partitions.tmp" in n]
    with pytest.raises(DataError, match="line 2 of .*: no key 'text'"):  # the whole file's line number
        src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"body": "b"}, {"text": "c"}, {"text": "d"}])
        run(build_parser().parse_args(["--input", src, "--output-prefix", str(tmp_path / "bad"), "--no-progress",
                                       "--partitions", "2", "--tokenizer-type", "ByteLevelTokenizer"]))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bad_")]


def test_partitions_below_one_is_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    rc = main(["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "ByteLevelTokenizer",
               "--partitions", "0", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["preprocess_data.py: error: --partitions 0 must be >= 1"]

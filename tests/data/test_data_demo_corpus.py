"""The demo corpus: stdlib sources, byte-level, cached, built once when ranks race."""
import multiprocessing as mp
import os
import time

import numpy as np

import pytest

from dcp_ext.data import demo_corpus
from dcp_ext.data.demo_corpus import ensure_demo_corpus, stdlib_files
from dcp_ext.data.indexed import IndexedDocuments

N = 25


def _ensure(cache):
    return ensure_demo_corpus(cache, max_files=N)


def test_selection_is_sorted_real_sources():
    files = stdlib_files(N)
    assert len(files) == N and files == stdlib_files(N)
    assert all(f.endswith(".py") and "/test/" not in f and "site-packages" not in f for f in files)


@pytest.mark.dist
def test_built_once_under_concurrent_calls(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    orig = demo_corpus._build

    def counting(prefix, files):
        with open(calls, "a") as f:
            f.write("x")
        time.sleep(0.3)  # let the other processes arrive while this one builds
        orig(prefix, files)

    monkeypatch.setattr(demo_corpus, "_build", counting)
    with mp.get_context("fork").Pool(4) as pool:
        prefixes = pool.map(_ensure, [str(tmp_path / "cache")] * 4)
    assert len(set(prefixes)) == 1 and calls.read_text() == "x"
    docs = IndexedDocuments(prefixes[0])
    blocks = [b for f in stdlib_files(N) for b in demo_corpus.top_level_blocks(open(f, "rb").read()) if b.strip()]
    assert docs.lengths.tolist() == [len(b) + 1 for b in blocks]  # bytes + EOD
    assert docs.tokens(0)[:-1].astype(np.uint8).tobytes() == blocks[0]
    assert docs.tokens(0)[-1] == 256
    assert not [p for p in os.listdir(os.path.dirname(prefixes[0])) if ".tmp" in p]
    # cached: a second call returns at once without building
    assert ensure_demo_corpus(str(tmp_path / "cache"), max_files=N) == prefixes[0]
    assert calls.read_text() == "x"


def test_documents_are_top_level_blocks_of_each_module():
    source = b'"""doc"""\nimport os\n\n@dec\n@dec2\ndef f():\n    def g(): pass\n    return 1\nclass C:\n    x = 1\n\nasync def h(): pass\n'
    blocks = demo_corpus.top_level_blocks(source)
    assert b"".join(blocks) == source
    assert [b.split(b"\n")[0] for b in blocks] == [b'"""doc"""', b"@dec", b"class C:", b"async def h(): pass"]
    for f in stdlib_files(N):
        raw = open(f, "rb").read()
        assert b"".join(demo_corpus.top_level_blocks(raw)) == raw

"""The demo's corpus: the Python standard library's own `.py` sources, byte-level tokenized.

Why: the demo must train on real documents of very different lengths on any machine with
Python, offline. The standard library is such a corpus. Selection: every `.py` under the
stdlib directory, sorted by relative path, minus tests, site-/dist-packages and caches, at
most `max_files`. A document is one top-level block of a module, as function-level code
corpora cut them: the module's prelude (docstring, imports, constants), then each
top-level `def`/`class` with its decorators; so lengths are long-tailed at laptop scale
(Python 3.11 here: 6,443 documents, median 466 bytes, p90 3.6 KB, 17% above 2 KB, the
longest 740 KB), where whole files would all be longer than the demo's 2,048-token limit.
Bytes are the tokens (ByteLevelTokenizer: 256 bytes + EOD = 256, vocab 257), EOD appended.

`ensure_demo_corpus(cache_dir)` returns the data prefix. It is cached (keyed by the
Python version and the selection) and safe when several ranks call it at once: a file
lock lets one process build while the others wait, and the files are renamed into place
only when complete.
"""
from __future__ import annotations

import os
import sys
import sysconfig

import numpy as np

from dcp_ext.data.errors import DataError
from dcp_ext.data.progress import Progress

VERSION = 2  # 2: documents are top-level blocks, not whole files
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                "lib2to3", "ensurepip"}


def stdlib_files(max_files: int = 3000) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE_DIRS)
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    out.sort(key=lambda p: os.path.relpath(p, root))
    return out[:max_files]


_TOP_LEVEL_START = (b"def ", b"async def ", b"class ", b"@")


def top_level_blocks(source: bytes) -> list[bytes]:
    """A module cut before each top-level definition (its decorators included); the
    pieces concatenate back to `source`."""
    blocks, current, previous = [], [], b""
    for line in source.splitlines(keepends=True):
        starts = line.startswith(_TOP_LEVEL_START) and not previous.startswith(b"@")
        if starts and current:
            blocks.append(b"".join(current))
            current = []
        current.append(line)
        previous = line
    if current:
        blocks.append(b"".join(current))
    return blocks


def demo_prefix(cache_dir: str, max_files: int = 3000) -> str:
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_v{VERSION}_n{max_files}"
    return os.path.join(os.path.abspath(cache_dir), f"demo_corpus_{tag}", "stdlib_text_document")


def _build(prefix: str, files: list[str]) -> None:
    from dcp_ext.data.indexed import DocumentWriter
    from dcp_ext.data.tokenizers import ByteLevelTokenizer

    tok = ByteLevelTokenizer()
    writer = DocumentWriter(prefix, tok.vocab_size)
    total = sum(os.path.getsize(f) for f in files)
    try:
        with Progress("demo corpus: stdlib .py files", total=total, unit="B") as bar:
            for path in files:
                with open(path, "rb") as f:
                    raw = f.read()
                bar.update(len(raw))
                for block in top_level_blocks(raw):
                    if not block.strip():
                        continue
                    ids = np.frombuffer(block, dtype=np.uint8).astype(np.uint16)
                    writer.add(np.append(ids, np.uint16(tok.eod)))
        writer.finalize({"tokenizer": dict(tok.unique_identifiers), "eod": tok.eod,
                         "source": "python stdlib, top-level blocks", "files": len(files), "append_eod": True})
    except BaseException:
        writer.abort()
        raise


def ensure_demo_corpus(cache_dir: str, max_files: int = 3000) -> str:
    """Build the demo corpus once; return its data prefix (for --data-path)."""
    from filelock import FileLock

    from dcp_ext.data.indexed import check_prefix

    prefix = demo_prefix(cache_dir, max_files)
    if os.path.isfile(prefix + ".meta.json"):  # written last: the dataset is complete
        return prefix
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with FileLock(prefix + ".lock"):
        if not os.path.isfile(prefix + ".meta.json"):
            files = stdlib_files(max_files)
            if not files:
                raise DataError(f"no .py files under {sysconfig.get_paths()['stdlib']} for the demo corpus")
            _build(prefix, files)
    check_prefix(prefix)
    return prefix

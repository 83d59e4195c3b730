"""A small corpus made the same way on every machine, for fixtures trained on it.

Why it exists: tests/fixtures/checkpoint_before_rename holds a checkpoint the older code trained
on this corpus; the test that resumes it builds the corpus again instead of keeping the data
files in git. The token ids come from a plain linear congruential generator (no library whose
random stream could change between versions): 48 documents of 20 to 599 tokens, ids 0-254,
each ended by EOD = 255.
"""
from __future__ import annotations

import os

DOCUMENTS = 48
VOCAB = 256  # ids 0-254, EOD 255


def _stream(seed: int):
    state = seed
    while True:
        state = (6364136223846793005 * state + 1442695040888963407) % (1 << 64)
        yield state >> 33


def fixture_documents() -> list[list[int]]:
    draw = _stream(2026)
    docs = []
    for _ in range(DOCUMENTS):
        n = 20 + next(draw) % 580
        docs.append([next(draw) % 255 for _ in range(n)] + [255])
    return docs


def write_fixture_corpus(folder: str) -> str:
    """The corpus as `folder`/corpus_text_document (.bin/.idx); returns that prefix."""
    from dcp_ext.data.indexed import write_documents

    return write_documents(os.path.join(folder, "corpus_text_document"), fixture_documents(), vocab_size=VOCAB)

"""GPT-2 byte-level BPE from a local vocab.json + merges.txt (Megatron's GPT2BPETokenizer).

Why our own: megatron.core 0.16's GPT2BPETokenizer goes through HuggingFace `transformers`
(not a dependency here, and it may try to download files). This is the published GPT-2
algorithm: bytes mapped to printable unicode, pre-split by GPT-2's pattern, then greedy
merges by rank. With the `regex` package installed the pre-split pattern is GPT-2's exact
one; without it, the standard library's `re` uses the closest classes (identical on ASCII
and ordinary letters/digits; may differ on rare numeric symbols such as superscripts).
"""
from __future__ import annotations

import json
from functools import lru_cache

try:  # exact GPT-2 pre-tokenisation needs unicode property classes
    import regex as _re

    _PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
except ImportError:  # pragma: no cover - depends on the environment
    import re as _re

    _L = r"[^\W\d_]"  # letters (also No/Nl numerics: the documented approximation)
    _N = r"\d"
    _PATTERN = (rf"""'s|'t|'re|'ve|'m|'ll|'d| ?{_L}+| ?{_N}+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")

EOD_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _pairs(word: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


class GPT2BPE:
    def __init__(self, vocab_file: str, merge_file: str):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: dict[str, int] = json.load(f)
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        merges = [tuple(line.split()) for line in lines
                  if line.strip() and not line.startswith("#version")]
        self.bpe_ranks = {tuple(m): i for i, m in enumerate(merges) if len(m) == 2}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pat = _re.compile(_PATTERN)
        self._cache: dict[str, list[str]] = {}

    def bpe(self, token: str) -> list[str]:
        hit = self._cache.get(token)
        if hit is not None:
            return hit
        word = tuple(token)
        pairs = _pairs(word)
        while pairs:
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new: list[str] = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new.extend(word[i:])
                    break
                new.extend(word[i:j])
                i = j
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
            if len(word) == 1:
                break
            pairs = _pairs(word)
        out = list(word)
        if len(self._cache) < 100_000:
            self._cache[token] = out
        return out

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self.pat.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for sub in self.bpe(mapped):
                try:
                    ids.append(self.encoder[sub])
                except KeyError:
                    raise KeyError(f"BPE piece {sub!r} is not in the vocabulary") from None
        return ids

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

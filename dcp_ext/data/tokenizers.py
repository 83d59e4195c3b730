"""Megatron's tokenizer types behind one small interface, plus Megatron's vocab padding.

Why thin wrappers of our own: megatron.core 0.16's tokenizers reach HuggingFace
`transformers` for GPT2BPE and may download vocabularies; its byte-level tokenizer uses
id 0 (the NUL byte) as EOD. Here every tokenizer works from local files only:

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    tok.tokenize(str) -> list[int]; tok.detokenize(ids) -> str; tok.vocab_size; tok.eod

`unique_identifiers` makes them usable as the tokenizer of megatron.core's GPTDataset
(it hashes them into its cache keys). HuggingFace and SentencePiece wrappers need their
libraries installed and a local path; nothing is fetched from a hub.
"""
from __future__ import annotations

import os
from collections import OrderedDict

from dcp_ext.data.errors import DataError
from dcp_ext.data.lengths import round_up

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "ByteLevelTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
)


class Tokenizer:
    """What the data layer needs from a tokenizer."""

    name = "Tokenizer"
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(self._identity())

    def _identity(self) -> list[tuple[str, object]]:
        return [("class", self.name), ("vocab_size", self.vocab_size), ("eod", self.eod)]

    def __repr__(self) -> str:
        return f"{self.name}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes are the ids 0..255; EOD is 256; vocab_size 257."""

    name = "ByteLevelTokenizer"

    def __init__(self):
        self.vocab_size = 257
        self.eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: text is space-separated ids.

    As in Megatron, `--vocab-size V` gives ids 0..V-1 for text and EOD = V (vocab_size V+1).
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise DataError("NullTokenizer needs --vocab-size >= 1")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer expects space-separated integers ({e})") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class GPT2BPETokenizer(Tokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        from dcp_ext.data.gpt2_bpe import EOD_TOKEN, GPT2BPE

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise DataError(f"GPT2BPETokenizer needs {flag}")
            if not os.path.isfile(path):
                raise DataError(f"{flag} not found: {path}")
        try:
            self.bpe = GPT2BPE(vocab_file, merge_file)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read GPT-2 vocab/merges {vocab_file}, {merge_file}: {e}") from None
        if EOD_TOKEN not in self.bpe.encoder:
            raise DataError(f"{vocab_file} has no {EOD_TOKEN} token")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.vocab_size = len(self.bpe.encoder)
        self.eod = self.bpe.encoder[EOD_TOKEN]

    def tokenize(self, text: str) -> list[int]:
        return self.bpe.encode(text)

    def detokenize(self, ids) -> str:
        return self.bpe.decode(ids)

    def _identity(self):
        return super()._identity() + [("vocab_file", os.path.abspath(self.vocab_file)),
                                      ("merge_file", os.path.abspath(self.merge_file))]


class HuggingFaceTokenizer(Tokenizer):
    """A local HuggingFace tokenizer: a directory for `transformers`, or a tokenizer.json."""

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str):
        if not tokenizer_model:
            raise DataError("HuggingFaceTokenizer needs --tokenizer-model (a local path)")
        if not os.path.exists(tokenizer_model):
            raise DataError(f"--tokenizer-model not found: {tokenizer_model} "
                            "(only local tokenizers are supported; nothing is downloaded)")
        self.path = tokenizer_model
        self._hf = None
        self._fast = None
        try:
            import transformers  # noqa: F401
        except ImportError:
            transformers = None
        if transformers is not None:
            from transformers import AutoTokenizer

            path = os.path.dirname(tokenizer_model) if os.path.isfile(tokenizer_model) else tokenizer_model
            try:
                self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except Exception as e:  # transformers raises OSError, ValueError, or the tokenizers library's Exception
                damaged = damaged_tokenizer_json(path)
                if damaged:  # name the file that is broken, not transformers' guess
                    raise DataError(damaged) from None
                raise DataError(f"--tokenizer-model {tokenizer_model}: cannot load the tokenizer "
                                f"({_first_line(e)})") from None
            self.vocab_size = len(self._hf)
            eod = self._hf.eos_token_id
            if eod is None:  # a bare tokenizer.json names no eos token: the usual end-of-text tokens
                vocab = self._hf.get_vocab()
                eod = next((vocab[n] for n in EOD_NAMES if n in vocab), None)
        else:
            try:
                from tokenizers import Tokenizer as FastTokenizer
            except ImportError:
                raise DataError("HuggingFaceTokenizer needs `pip install transformers` "
                                "(or `tokenizers` with a tokenizer.json file)") from None
            file = tokenizer_model if os.path.isfile(tokenizer_model) else \
                os.path.join(tokenizer_model, "tokenizer.json")
            if not os.path.isfile(file):
                raise DataError(f"no tokenizer.json in {tokenizer_model}")
            try:
                self._fast = FastTokenizer.from_file(file)
            except Exception as e:  # the tokenizers library raises a bare Exception on a damaged file
                raise DataError(f"{file} is not a valid tokenizer.json ({_first_line(e)})") from None
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            eod = None
            for name in EOD_NAMES:
                eod = self._fast.token_to_id(name)
                if eod is not None:
                    break
        if eod is None:
            raise DataError(f"tokenizer {tokenizer_model} has no end-of-sequence token to use as EOD")
        self.eod = int(eod)

    def tokenize(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._fast.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._fast.decode(ids)

    def _identity(self):
        return super()._identity() + [("path", os.path.abspath(self.path))]


class SentencePieceTokenizer(Tokenizer):
    """A local SentencePiece model (Megatron's SentencePiece/GPTSentencePiece/Llama2 types)."""

    name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str, name: str = "SentencePieceTokenizer"):
        self.name = name
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise DataError(f"{name} needs --tokenizer-model pointing at a .model file "
                            f"(got {tokenizer_model})")
        try:
            import sentencepiece
        except ImportError:
            raise DataError(f"{name} needs `pip install sentencepiece`") from None
        self.path = tokenizer_model
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{tokenizer_model} is not a SentencePiece model ({_first_line(e)})") from None
        self.vocab_size = int(self.sp.vocab_size())
        eod = int(self.sp.eos_id())
        if eod < 0:
            raise DataError(f"{tokenizer_model} defines no EOS id to use as EOD")
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def _identity(self):
        return super()._identity() + [("path", os.path.abspath(self.path))]


EOD_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")  # tried in order when none is named


def damaged_tokenizer_json(folder: str) -> str | None:
    """The line naming `folder`'s tokenizer.json as damaged, when it is there and the
    tokenizers library cannot read it; None otherwise."""
    file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        from tokenizers import Tokenizer as FastTokenizer
    except ImportError:
        return None
    try:
        FastTokenizer.from_file(file)
    except Exception as e:  # the tokenizers library raises a bare Exception on a damaged file
        return f"{file} is not a valid tokenizer.json ({_first_line(e)})"
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def build_tokenizer(tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None,
                    tokenizer_model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """Megatron's `--tokenizer-type` names; raises DataError with one line on bad input."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return SentencePieceTokenizer(tokenizer_model, name=tokenizer_type)
    raise DataError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisible_by * tp."""
    multiple = make_vocab_size_divisible_by * tp
    return int(round_up(vocab_size, multiple))

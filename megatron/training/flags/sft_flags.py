"""Upstream's training-time `--sft`, as this fork's SFT data.

Why a module of its own: upstream's `pretrain_gpt.py --sft` (with `--tokenizer-type
SFTTokenizer`) reads chat JSONL at training time and, per conversation, trains on the
assistant's tokens only, each conversation attending to itself with its own positions. This
fork renders and tokenizes the conversations once, at preprocessing (`tools/preprocess_data.py
--sft`: the tokens plus a loss mask that marks the assistant's), and trains on those
documents. `--sft` here means the same training: it requires the training data to carry that
loss mask (a JSONL path, or data without a mask, is refused in one line that gives the
preprocessing command), and keeps conversations apart on the static path as upstream's packing
does (`--reset-position-ids --reset-attention-mask`; `--dcp` always masks by document).
`--tokenizer-type SFTTokenizer` then names the Hugging Face tokenizer of `--tokenizer-model`
that the data was preprocessed with (its vocabulary and end-of-document token).

What differs from upstream, said at start (`note`): the chat template is the preprocessing's,
and conversations are packed into full sequences (static) or by tokens (`--dcp`) rather than
one JSONL line per padded sample; the loss is per trained token either way.
"""
from __future__ import annotations

import os
from typing import Optional

SFT_TOKENIZER = "SFTTokenizer"


def add_sft_flags(parser) -> None:
    g = parser.add_argument_group("SFT (upstream's --sft)")
    g.add_argument("--sft", action="store_true",
                   help="supervised fine-tuning on data preprocessed with tools/preprocess_data.py --sft: loss on "
                        "the assistant's tokens only (its stored loss mask), each conversation its own document")


def refusals(args) -> list:
    """[(flags, line)]: upstream's SFT tokenizer outside --sft."""
    if args.tokenizer_type == SFT_TOKENIZER and not args.sft:
        return [(["--tokenizer-type"], "--tokenizer-type SFTTokenizer is upstream's tokenizer for --sft: add --sft "
                 "(SFT data preprocessed with tools/preprocess_data.py --sft), or use --tokenizer-type "
                 "HuggingFaceTokenizer")]
    return []


def fill_sft(args) -> None:
    """--sft's derived values (in `arguments.fill_derived`)."""
    if not args.sft:
        return
    args.reset_position_ids = args.reset_attention_mask = True  # one conversation, one document
    if args.tokenizer_type == SFT_TOKENIZER:
        args.tokenizer_type = "HuggingFaceTokenizer"  # the vocabulary the data was preprocessed with
        args.sft_tokenizer_given = True


def _train_prefixes(args) -> list[str]:
    from dcp_ext.data.documents import parse_blend

    blend = args.data_path if args.per_split_data_path is None else args.per_split_data_path[0]
    return parse_blend(blend)[0] if blend else []


def _preprocess_command(args, source: str) -> str:
    tok = f"--tokenizer-type {args.tokenizer_type or 'HuggingFaceTokenizer'}"
    if args.tokenizer_model:
        tok += f" --tokenizer-model {args.tokenizer_model}"
    stem = os.path.splitext(os.path.basename(source))[0] if os.path.isfile(source) else "DATA"
    return (f"tools/preprocess_data.py --input {source if os.path.isfile(source) else 'DATA.jsonl'} --sft {tok} "
            f"--output-prefix {stem}, then train on {stem}_sft_document")


def data_problem(args) -> Optional[str]:
    """With --sft, why the training data is not SFT data here (None when it is). After the
    data flags are resolved (`argument_checks.check_files`)."""
    if not args.sft or args.mock_data:
        return None
    from dcp_ext.data.indexed import LOSS_MASK_SUFFIX, idx_path

    for prefix in _train_prefixes(args):
        if os.path.isfile(idx_path(prefix + LOSS_MASK_SUFFIX)):
            continue
        if os.path.isfile(prefix):  # upstream's form: the chat JSONL itself
            return (f"--sft: {prefix} is a file, as upstream's --sft reads chat JSONL at training time; here the "
                    f"conversations are tokenized once with their loss mask: run {_preprocess_command(args, prefix)}")
        if os.path.isfile(idx_path(prefix)):
            return (f"--sft: {prefix} has no SFT loss mask ({prefix}{LOSS_MASK_SUFFIX}.idx), so it would train on "
                    f"every token: preprocess the chat data with {_preprocess_command(args, prefix)}, or drop --sft")
    return None  # a missing prefix is the data layer's line


def note(args) -> Optional[str]:
    """The line printed at start under --sft."""
    if not args.sft:
        return None
    tok = " (--tokenizer-type SFTTokenizer: the Hugging Face tokenizer of --tokenizer-model)" \
        if getattr(args, "sft_tokenizer_given", False) else ""
    return ("--sft: loss on the assistant's tokens only (the data's loss mask), each conversation its own document"
            f"{tok}; conversations as rendered at preprocessing, packed into full sequences"
            f"{' by tokens (--dcp)' if args.dcp else ''} rather than upstream's one padded sample per JSONL line")

"""Megatron's `get_args()`: the parsed flags, reachable from user forward-step functions."""
_ARGS = None


def set_args(args) -> None:
    global _ARGS
    _ARGS = args


def get_args():
    if _ARGS is None:
        raise RuntimeError("arguments are not parsed yet: call pretrain() first")
    return _ARGS


_TOKENIZER = None


def build_tokenizer(args):
    """Megatron's global tokenizer; sets args.padded_vocab_size and args.eod_token."""
    global _TOKENIZER
    from dcp_ext.data.tokenizers import build_tokenizer as build, padded_vocab_size

    tokenizer_type = args.tokenizer_type or ("ByteLevelTokenizer" if args.demo_corpus else "NullTokenizer")
    if tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        from megatron.training.argument_errors import ArgumentError

        raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
    _TOKENIZER = build(tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                       tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
    args.padded_vocab_size = padded_vocab_size(
        _TOKENIZER.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    args.eod_token = _TOKENIZER.eod
    return _TOKENIZER


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("tokenizer is not built yet: call pretrain() first")
    return _TOKENIZER

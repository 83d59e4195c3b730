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


def build_tokenizer(args, cluster=None):
    """Megatron's global tokenizer; sets args.eod_token and args.padded_vocab_size, the one
    place the vocabulary is padded: for every layout the planner could choose on `cluster`
    (a --dcp run: run_config.vocab_padding_for), else for --tensor-model-parallel-size
    (upstream's rule)."""
    global _TOKENIZER
    from dcp_ext.data.tokenizers import build_tokenizer as build, padded_vocab_size

    tokenizer_type = args.tokenizer_type or ("ByteLevelTokenizer" if args.demo_corpus else "NullTokenizer")
    if tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        from megatron.training.flags.argument_errors import ArgumentError

        raise ArgumentError(missing_tokenizer_line(args))
    _TOKENIZER = build(tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                       tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
    if cluster is not None:
        from megatron.training.adaptive.run_config import vocab_padding_for

        args.padded_vocab_size = vocab_padding_for(args, _TOKENIZER.vocab_size, cluster)
    else:
        args.padded_vocab_size = padded_vocab_size(
            _TOKENIZER.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        )
    args.eod_token = _TOKENIZER.eod
    return _TOKENIZER


def missing_tokenizer_line(args) -> str:
    """No tokenizer to build: name the --tokenizer-type the other tokenizer flags call for
    (upstream's GPT-3 example gives --vocab-file/--merge-file alone)."""
    if args.tokenizer_type is not None:
        return "--tokenizer-type NullTokenizer needs --vocab-size"
    if args.vocab_file or args.merge_file:
        return ("--vocab-file/--merge-file are given but no --tokenizer-type: add --tokenizer-type GPT2BPETokenizer "
                "(GPT-2 BPE vocabulary and merges)")
    if args.tokenizer_model:
        return ("--tokenizer-model is given but no --tokenizer-type: add --tokenizer-type HuggingFaceTokenizer (a "
                "Hugging Face tokenizer folder or name) or SentencePieceTokenizer (a .model file)")
    return ("no tokenizer: give --tokenizer-type (GPT2BPETokenizer with --vocab-file and --merge-file, "
            "HuggingFaceTokenizer with --tokenizer-model, ...) or --tokenizer-type NullTokenizer --vocab-size N")


def get_tokenizer():
    if _TOKENIZER is None:
        raise RuntimeError("tokenizer is not built yet: call pretrain() first")
    return _TOKENIZER

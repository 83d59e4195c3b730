"""Pretrain a GPT with megatron-core, static or adaptive (`--dcp`) parallelism.

    torchrun --nproc_per_node=4 pretrain_gpt_dcp.py <Megatron flags>
    torchrun --nproc_per_node=4 pretrain_gpt_dcp.py            # the CPU demo (examples/cpu_demo.yaml + --dcp)

Thin, like Megatron's pretrain_gpt.py: the model, data and forward-step providers, then
`pretrain()`. With no flags at all it runs the embedded default, the CPU demo.
"""
from __future__ import annotations

import os
import sys
from functools import partial

import torch

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "cpu_demo.yaml")


def model_provider(config, pre_process: bool = True, post_process: bool = True, pg_collection=None):
    """megatron-core GPTModel for one pipeline stage (TE layers on GPUs, ours on CPUs)."""
    from dcp_ext.runtime.stages.model import build_gpt_model
    from megatron.training.global_vars import get_args
    from megatron.training.flags.model_flags import Machine, uses_transformer_engine

    args = get_args()
    use_te = uses_transformer_engine(args, Machine.here())  # --transformer-impl, --attention-backend local
    return build_gpt_model(
        config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        use_te=use_te,
        cpu_attention=args.dcp_cpu_attention,
    )


def data_prefixes(args) -> list[str]:
    """--data-path, or the demo corpus built once from the standard library (rank 0 builds)."""
    if not args.demo_corpus:
        return args.data_path
    from dcp_ext.data.demo_corpus import ensure_demo_corpus

    cache = args.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "cache")
    return [ensure_demo_corpus(os.path.join(cache, "demo"))]


def train_valid_test_datasets_provider(args):
    """Fixed-length samples (upstream Megatron's GPTDataset) for the static path."""
    from dcp_ext.data.gpt_dataset import build_fixed_length_datasets
    from megatron.training.global_vars import get_tokenizer

    eval_runs = (args.train_iters // args.eval_interval if args.eval_interval else 0) + 1  # + the end-of-run one
    num_samples = (
        args.train_iters * args.global_batch_size,
        eval_runs * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    )
    cache = args.data_cache_path  # None: megatron-core's default, next to the data (as upstream)
    if args.mock_data:  # megatron-core's MockGPTDataset, as upstream's --mock-data
        from dcp_ext.data.gpt_dataset import build_mock_fixed_length_datasets

        return build_mock_fixed_length_datasets(
            args.seq_length, args.seed, get_tokenizer(), num_samples, cache,
            reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss)
    return build_fixed_length_datasets(
        data_prefixes(args), args.split, args.seq_length, args.seed, get_tokenizer(), num_samples, cache,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, eval_iters=args.eval_iters,
        per_split=args.per_split_data_path,
    )


def document_datasets_provider(args):
    """One document per sample, lengths known before batches form (the --dcp path)."""
    from dcp_ext.data.documents import build_document_datasets
    from megatron.training.global_vars import get_tokenizer

    if args.mock_data:  # documents with the spread of a real length distribution
        from dcp_ext.data.mock_documents import build_mock_document_datasets

        tok = get_tokenizer()
        return build_mock_document_datasets(args.dcp_max_seq_len, tok.vocab_size, tok.eod, args.seed, args.eval_iters)
    return build_document_datasets(
        data_prefixes(args), args.split, args.seed, args.dcp_max_seq_len,
        split_long_documents=args.dcp_split_long_documents, vocab_size=get_tokenizer().vocab_size,
        tokenizer=get_tokenizer(), eval_iters=args.eval_iters, per_split=args.per_split_data_path,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss summed over this micro-batch, with its token count (Megatron's 3-tuple)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    from megatron.training.loop.batches import get_batch

    batch = get_batch(data_iterator, model)  # on the model's device
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=batch["packed_seq_params"],
    )
    return output, partial(loss_func, batch["loss_mask"])


def quiet_known_warnings() -> None:
    """megatron-core warns at import about optional GPU packages; say it once in the README instead."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*is deprecated.*")


def main(argv=None) -> None:
    try:
        quiet_known_warnings()
        from dcp_ext.compat import cpu_compat
        from megatron.training.training import pretrain

        cpu_compat.install()  # once per process, here at the entry (a no-op with CUDA)

        argv = sys.argv[1:] if argv is None else argv
        if not argv:  # the embedded default: the CPU demo on the adaptive runtime
            argv = ["--yaml-cfg", DEMO_CONFIG, "--dcp"]
        pretrain(train_valid_test_datasets_provider, model_provider, forward_step, argv=argv,
                 document_datasets_provider=document_datasets_provider)
    except KeyboardInterrupt:  # Ctrl-C while starting up (pretrain says it once training has begun)
        if os.environ.get("RANK", "0") == "0":
            print("error: interrupted (SIGINT, Ctrl-C) while starting: nothing was trained", file=sys.stderr,
                  flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()

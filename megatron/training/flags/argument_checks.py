"""Every check of a parsed configuration, in one place (`validate_args`).

Why a module of its own: the parser (`arguments`) says which flags exist and what they
default to; this module says which values and combinations are valid: ranges of every
numeric flag, relations between flags, the optimizer features --dcp cannot run, and the
syntax of input files named by flags. Each failure is one `ArgumentError` line that names
the fix. The flag families with flags of their own (`loop_flags`, `model_flags`,
`upstream_flags`) keep their checks next to their definitions; `validate_args` calls them.
"""
from __future__ import annotations

import argparse
import math
import os
import re

from megatron.training.flags import loop_flags
from megatron.training.flags.argument_errors import ArgumentError
from megatron.training.flags import flag_refusals, sft_flags
from megatron.training.flags.model_flags import check_model_flags

# Ranges of every numeric flag, checked before any relation (a zero would divide; a negative
# count or a NaN would train on nonsense). (low, low inclusive, high, high inclusive); None: open.
_AT_LEAST_1 = (1, True, None, False)
_AT_LEAST_0 = (0, True, None, False)
_POSITIVE = (0, False, None, False)
_UNIT = (0, True, 1, False)  # [0, 1)
RANGES = {
    **{name: _AT_LEAST_1 for name in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "seq_length", "max_position_embeddings", "rotary_base", "make_vocab_size_divisible_by",
        "recompute_num_layers", "distributed_timeout_minutes", "micro_batch_size", "global_batch_size",
        "exit_interval", "hysteresis", "max_nan_iterations", "vocab_size", "save_interval", "dcp_global_batch_tokens",
        "dcp_max_seq_len", "dcp_candidates", "ddp_bucket_size")},
    **{name: _AT_LEAST_0 for name in (
        "train_iters", "lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters", "eval_iters", "num_workers", "seed",
        "lr", "min_lr", "weight_decay", "clip_grad")},
    **{name: _POSITIVE for name in (
        "norm_epsilon", "init_method_std", "adam_eps", "loss_scale", "initial_loss_scale", "min_loss_scale",
        "loss_scale_window", "dcp_device_tflops", "dcp_device_memory_gb")},
    **{name: _UNIT for name in ("adam_beta1", "adam_beta2", "sgd_momentum", "hidden_dropout", "attention_dropout")},
    "lr_warmup_fraction": (0, True, 1, True),
}
_RANGE_WORDS = {_AT_LEAST_1: "must be >= 1", _AT_LEAST_0: "must be >= 0", _POSITIVE: "must be > 0",
                _UNIT: "must be in [0, 1)"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag within its range, and every float finite: one line naming the flag."""
    for dest, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value) and dest in RANGES:
            raise ArgumentError(f"{_flag(dest)} {_show(value)} is not a finite number")
    for dest, rng in RANGES.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, bool):
            continue
        lo, lo_in, hi, hi_in = rng
        ok = (lo is None or (value >= lo if lo_in else value > lo)) and (hi is None or (value <= hi if hi_in else value < hi))
        if not ok:
            words = _RANGE_WORDS.get(rng) or f"must be in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
            raise ArgumentError(f"{_flag(dest)} {_show(value)} {words}")


def data_paths_given(args: argparse.Namespace) -> bool:
    """Upstream's other ways to name the data (dcp_ext/data/data_paths.py)."""
    return any(getattr(args, name, None) is not None for name in (
        "data_args_path", "train_data_path", "valid_data_path", "test_data_path", "per_split_data_args_path"))


def resolve_data_paths(args) -> None:
    """The data flags in their one form (`dcp_ext.data.data_paths.resolve`): `args.data_path`
    becomes the blend (read from --data-args-path when given), `args.per_split_data_path` the
    three per-split blends or None."""
    from dcp_ext.data.data_paths import resolve

    blend, per_split = resolve(args.data_path, args.data_args_path, args.train_data_path, args.valid_data_path,
                               args.test_data_path, args.per_split_data_args_path)
    args.data_path, args.per_split_data_path = blend, per_split
    if per_split is not None or args.data_args_path is not None:
        args.demo_corpus = False  # given data wins over the demo's, as --data-path does


def check_files(args: argparse.Namespace) -> None:
    """Input files whose syntax is known before anything starts: the blend, the split, the profile."""
    from dcp_ext.data.documents import parse_blend, split_bookends
    from dcp_ext.data.errors import DataError

    try:
        resolve_data_paths(args)  # --data-args-path, --train/valid/test-data-path, --per-split-data-args-path
        if args.data_path:
            parse_blend(args.data_path)
        split_bookends(args.split)
    except DataError as e:
        raise ArgumentError(str(e)) from None
    problem = sft_flags.data_problem(args)
    if problem:
        raise ArgumentError(problem)
    if args.load:
        tracker = "latest_checkpointed_iteration.txt"
        if os.path.exists(args.load) and not os.path.isdir(args.load):
            raise ArgumentError(f"--load {args.load} is a file, not a checkpoint directory (the folder that holds "
                                f"{tracker})")
        name = os.path.basename(os.path.normpath(args.load))
        if (re.match(r"^iter_\d{7}(\.old)?$", name) and not os.path.isfile(os.path.join(args.load, tracker))
                and os.path.isfile(os.path.join(args.load, "metadata.json"))):
            raise ArgumentError(f"--load {args.load} is one checkpoint's folder: pass its parent "
                                f"{os.path.dirname(os.path.normpath(args.load))} (the folder that holds {tracker})")
    if args.dcp_cost_profile is not None:
        from dcp_ext.planning.profile import profile_problem

        problem = profile_problem(args.dcp_cost_profile)
        if problem:
            raise ArgumentError(f"--dcp-cost-profile {args.dcp_cost_profile}: {problem}")


# Optimizer features the --dcp fixed sharding cannot run (read with getattr: the flags may
# come from upstream's parser); everything else of the optimizer is honoured there.
DCP_REFUSED_OPTIMIZER_SWITCHES = ("optimizer_cpu_offload", "use_precision_aware_optimizer", "optimizer_cuda_graph",
                                  "overlap_param_gather_with_optimizer_step", "use_torch_optimizer_for_cpu_offload")


def check_dcp_optimizer(args: argparse.Namespace) -> None:
    if args.optimizer not in ("adam", "sgd"):
        raise ArgumentError(f"--optimizer {args.optimizer} is not supported with --dcp (its fixed optimizer sharding "
                            "runs adam or sgd): use --optimizer adam or sgd, or drop --dcp")
    for dest in DCP_REFUSED_OPTIMIZER_SWITCHES:
        if getattr(args, dest, False):
            raise ArgumentError(f"{_flag(dest)} is not supported with --dcp (the optimizer state is one fixed sharding "
                                "over all ranks, in fp32 on the device): drop it or drop --dcp")
    if getattr(args, "no_weight_decay_cond_type", None):
        raise ArgumentError(f"--no-weight-decay-cond-type {args.no_weight_decay_cond_type} is not supported with "
                            "--dcp (biases and 1-D parameters skip weight decay, megatron-core's default): drop it")
    dec, dec_min = args.decoupled_lr, args.decoupled_min_lr
    if dec_min is not None and dec is not None and dec_min > dec:
        raise ArgumentError(f"--decoupled-min-lr {_show(dec_min)} is above --decoupled-lr {_show(dec)}")


def validate_args(args: argparse.Namespace) -> None:
    """The whole configuration, in one place: required flags, ranges, YAML types (at load),
    relations between flags, and the syntax of input files named by flags."""
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ArgumentError(message)

    flag_refusals.check(args)  # first: the line's refused flags, all of them, are the answer, whatever else it holds
    if args.dcp_planner == "dcp":  # its old name: one planner, one name from here on (the note says so)
        args.dcp_planner, args.dcp_planner_renamed = "cp-buckets", True
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "lr"):
        need(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    need(args.train_iters is not None, "--train-iters (or --train-samples) is required")
    check_ranges(args)
    check_model_flags(args)  # before the relations below: it turns --sequence-parallel off at TP1, as upstream
    need(args.dcp_device_memory is None or args.dcp_device_memory_gb is None,
         "--dcp-device-memory and --dcp-device-memory-gb both give the device memory: keep one")
    for flag in ("dcp_layer_strategies", "dcp_uneven_stages"):
        need(getattr(args, flag, "off") != "on" or (args.dcp and args.dcp_planner == "adaptive"),
             f"{_flag(flag)} on is a choice of the adaptive planner: add --dcp (with --dcp-planner adaptive) or drop it")
    need(args.min_lr <= args.lr, f"--min-lr {_show(args.min_lr)} is above --lr {_show(args.lr)}: the decay would raise it")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    need(min(tp, pp, cp) >= 1, "parallel sizes must be >= 1")
    need(
        args.world_size % (tp * pp * cp) == 0,
        f"world size {args.world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}: "
        "change the parallel sizes or --nproc_per_node",
    )
    need(
        args.num_attention_heads % tp == 0,
        f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}",
    )
    need(
        args.num_query_groups % tp == 0,
        f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}",
    )
    need(
        args.num_attention_heads % args.num_query_groups == 0,
        f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups {args.num_query_groups}",
    )
    need(
        args.hidden_size % args.num_attention_heads == 0 or args.kv_channels is not None,
        f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}: "
        "change one of them, or give each head's size with --kv-channels",
    )
    need(
        args.num_layers % pp == 0,
        f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
    )
    if cp > 1:
        need(
            args.seq_length % (2 * cp) == 0,
            f"--seq-length {args.seq_length} must be a multiple of 2*context-parallel-size = {2 * cp}",
        )
    if args.sequence_parallel:
        need(tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")
        need(args.seq_length % tp == 0, f"--seq-length {args.seq_length} must be a multiple of tp = {tp} with --sequence-parallel")
    need(args.max_position_embeddings >= args.seq_length or args.position_embedding_type != "learned_absolute",
         f"--max-position-embeddings {args.max_position_embeddings} is smaller than --seq-length {args.seq_length}")
    if args.dcp and args.position_embedding_type == "learned_absolute":
        need(args.dcp_max_seq_len <= args.max_position_embeddings,
             f"--dcp-max-seq-len {args.dcp_max_seq_len} exceeds --max-position-embeddings "
             f"{args.max_position_embeddings} (learned absolute positions): lower it or raise --max-position-embeddings")
    need(args.ffn_hidden_size % tp == 0,
         f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    need(not (args.bf16 and args.fp16), "--bf16 and --fp16 are mutually exclusive")
    if args.fp16 and args.loss_scale is None:
        need(args.initial_loss_scale > 0 and args.min_loss_scale > 0, "--initial-loss-scale and --min-loss-scale must be > 0")
        need(args.initial_loss_scale >= args.min_loss_scale,
             f"--initial-loss-scale {args.initial_loss_scale:g} is below --min-loss-scale {args.min_loss_scale:g}")
        need(args.loss_scale_window > 0 and args.hysteresis > 0, "--loss-scale-window and --hysteresis must be > 0")
    need(args.loss_scale is None or args.loss_scale > 0, "--loss-scale must be > 0 (omit it for dynamic loss scaling)")
    dp = args.data_parallel_size
    if not args.dcp and args.overlap_param_gather:  # megatron-core's DDP gathers through the distributed optimizer
        need(args.use_distributed_optimizer, "--overlap-param-gather needs --use-distributed-optimizer")
        need(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    need(args.ddp_bucket_size is None or args.ddp_bucket_size > 0, "--ddp-bucket-size must be > 0 (elements)")
    if not args.dcp:
        need(
            args.global_batch_size % (args.micro_batch_size * dp) == 0,
            f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size x data-parallel-size "
            f"= {args.micro_batch_size} x {dp}",
        )
        args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    else:
        if args.dcp_global_batch_tokens is None:  # the static line's batch, in tokens
            need(args.global_batch_size is not None, "--dcp needs --dcp-global-batch-tokens or --global-batch-size")
            args.dcp_global_batch_tokens = args.global_batch_size * args.seq_length
        need(args.dcp_global_batch_tokens > 0, "--dcp-global-batch-tokens must be > 0 (tokens per global batch)")
        need(args.dcp_max_seq_len <= args.dcp_global_batch_tokens,
             f"--dcp-max-seq-len {args.dcp_max_seq_len} exceeds --dcp-global-batch-tokens {args.dcp_global_batch_tokens}")
        need(0.0 <= args.dcp_memory_margin < 1.0, "--dcp-memory-margin must be in [0, 1)")
        check_dcp_optimizer(args)
        args.num_microbatches = None
    if args.save_interval is not None:  # without --save it saves nothing (upstream's leniency)
        need(args.save_interval > 0, "--save-interval must be > 0")
    need(args.demo_corpus or args.mock_data or args.data_path or data_paths_given(args),
         "--data-path is required (or --mock-data / --demo-corpus)")
    if args.recompute_granularity == "full":
        need(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        need(args.recompute_num_layers is not None,
             f"--recompute-granularity full needs --recompute-num-layers (1 to {args.num_layers // pp}, "
             "the layers per pipeline stage)")
    elif args.recompute_granularity == "selective":
        need(args.recompute_num_layers is None, "--recompute-num-layers applies to --recompute-granularity full, "
             "not selective")
    if args.lr_warmup_iters and not args.train_iters and not args.lr_decay_iters and args.train_samples is None:
        need(False, f"--train-iters {args.train_iters} trains nothing, and --lr-decay-iters (which defaults to it) "
                    f"leaves no room for --lr-warmup-iters {args.lr_warmup_iters}: give --train-iters > 0, or "
                    "--lr-decay-iters, or drop --lr-warmup-iters")
    if args.lr_warmup_iters:
        need(args.lr_warmup_iters < (args.lr_decay_iters or 0),
             f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters {args.lr_decay_iters} "
             "(default: --train-iters)")
    need(args.log_interval > 0 and (args.eval_interval is None or args.eval_interval > 0),
         "--log-interval and --eval-interval must be > 0")
    need(args.tensorboard_log_interval > 0 and args.tensorboard_queue_size > 0,
         "--tensorboard-log-interval and --tensorboard-queue-size must be > 0")
    need(not (args.use_distributed_optimizer and args.optimizer == "sgd"), "--use-distributed-optimizer needs --optimizer adam")
    if args.lr_decay_style == "WSD":
        need(args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
             "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)")
    loop_flags.validate_loop_flags(args)
    check_files(args)

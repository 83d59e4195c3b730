"""Megatron-compatible command line for GPT jobs, plus the flags this fork adds.

Users bring their Megatron launch scripts: flag names, defaults and derived values follow
Megatron-LM's `arguments.py`. A YAML file (`--yaml-cfg`, read by `argument_yaml`) may hold
the same names as keys (dashes or underscores); flags on the command line win. Every
invalid combination ends with one line that names the fix (`argument_checks.validate_args`).
This module defines the flags, parses them and fills the derived values.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from megatron.training.flags import flag_refusals, loop_flags, sft_flags
from megatron.training.flags.argument_checks import check_ranges, validate_args
from megatron.training.flags.argument_errors import ArgumentError
from megatron.training.flags.argument_yaml import load_yaml_defaults
from megatron.training.flags.model_flags import add_model_flags
from megatron.training.flags.upstream_flags import add_upstream_flags

# what callers import from here (ArgumentError and validate_args are defined in argument_errors and
# argument_checks, which this module imports)
__all__ = ["ArgumentError", "build_parser", "parse_args", "parse_flags", "fill_derived", "validate_args",
           "world_size_from_env"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line instead of usage + message
        raise ArgumentError(message)


# argparse (Python < 3.13) takes "-1e-3" or "-inf" for a flag, so `--lr -1e-3` said "expected one
# argument". Any number is a value here (no flag of ours looks like one); range checks follow.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def allow_negative_numbers(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser._negative_number_matcher = NEGATIVE_NUMBER
    return parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt_dcp.py", allow_abbrev=False, add_help=True)
    p.add_argument("--yaml-cfg", type=str, default=None, help="YAML file whose keys are these flags' names")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="alias: --position-embedding-type rope")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine when it imports on a GPU, else local (our CPU attention)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the gradient reduce (--dcp: the push to the fixed sharding) with backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the parameter gather (--dcp: the pull from the fixed sharding) with forward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (--dcp: per bucket of the fixed sharding; "
                        "default 40M; 8 buckets for mid-size models, one under 1M elements)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (fp16, or bf16 if given); default: dynamic loss scaling under --fp16")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="initial dynamic loss scale (--fp16)")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="minimum dynamic loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="iterations without overflow after which the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the loss scale halves")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and all-reduce gradients in fp32 (always on with --bf16 unless --grad-reduce-in-bf16)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: accumulate and all-reduce gradients in bf16 instead of fp32")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--max-nan-iterations", type=int, default=10,
                   help="stop after this many skipped NaN/inf iterations in a row")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--split", type=str, default="969, 30, 1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--demo-corpus", action="store_true",
                   help="build (once, cached) a corpus from this Python's standard library sources and train on it "
                        "(--data-path, when given, wins)")
    g.add_argument("--tokenizer-type", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--data-cache-path", type=str, default=None)
    for split in ("train", "valid", "test"):  # upstream's per-split blends (dcp_ext/data/data_paths.py)
        g.add_argument(f"--{split}-data-path", nargs="*", default=None)
    g.add_argument("--data-args-path", type=str, default=None)
    g.add_argument("--per-split-data-args-path", type=str, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="start from this checkpoint's weights while --load holds none (as --finetune)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="load --load's checkpoint without checking its files against the checksums saved with it "
                        "(for a store that guarantees integrity itself)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=None,
                   help="evaluate every N iterations (default: only once, after training, as upstream)")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="also write 'iteration-time'")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--loss-log", type=str, default=None,
                   help="append each iteration's exact loss, grad norm and lr as JSON lines (last rank)")

    g = p.add_argument_group("adaptive parallelism (this fork)")
    g.add_argument("--dcp", action="store_true", help="plan the layout per iteration from the data")
    g.add_argument("--dcp-planner", choices=["adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis", "dcp"],
                   default="adaptive", help="dcp: the old name of cp-buckets, still accepted")
    g.add_argument("--dcp-global-batch-tokens", type=int, default=None,
                   help="tokens per global batch (default: --global-batch-size x --seq-length)")
    g.add_argument("--dcp-max-seq-len", type=int, default=None, help="default: --seq-length")
    g.add_argument("--dcp-split-long-documents", action="store_true",
                   help="split documents longer than --dcp-max-seq-len into chunks instead of truncating")
    g.add_argument("--dcp-candidates", type=int, default=16, help="size of the candidate layout pool")
    g.add_argument("--dcp-cost-profile", type=str, default=None, help="profile written by dcp-profile")
    g.add_argument("--dcp-memory-margin", type=float, default=0.1)
    g.add_argument("--dcp-log-plan", type=str, default=None, help="append each iteration's plan (JSON lines) here")
    g.add_argument("--dcp-device-tflops", type=float, default=None,
                   help="dense bf16 peak TFLOP/s of one device, for a GPU the planner's table does not know")
    g.add_argument("--dcp-device-memory-gb", type=float, default=None,
                   help="memory of one device in GiB (default: what torch reports for the device)")
    g.add_argument("--dcp-device-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory budget of one device, e.g. 256MB, 1.5GiB, 80GB (on CPU ranks: bytes for "
                        "tensors, the process's code and libraries not counted); the planner keeps every "
                        "replica's peak within it")
    g.add_argument("--dcp-recalibration", choices=["on", "off"], default="on",
                   help="refit the cost model from the run's own timings as it trains (off: the prices stay "
                        "the analytic or --dcp-cost-profile ones, so plans are bit-reproducible)")
    g.add_argument("--dcp-calibrate-at-start", choices=["on", "off"], default="on",
                   help="before training, run every candidate layout once on the first global batch (no "
                        "update) and choose the candidate pool from the measured prices (with "
                        "--dcp-recalibration on, on a fresh start)")
    g.add_argument("--dcp-layer-strategies", choices=["on", "off"], default="off",
                   help="ParaDySe: the adaptive planner may run each layer of a micro-batch under its own "
                        "re-factoring (tp, cp) of its replica's tp*cp ranks (plan contract v2)")
    g.add_argument("--dcp-uneven-stages", choices=["on", "off"], default="off",
                   help="OmniBal: the adaptive planner splits each pipelined layout's layers by the cost model "
                        "(the first and last stages also carry the embedding and the logits)")
    g.add_argument("--dcp-cpu-attention", choices=["math", "flash"], default="math",
                   help="CPU ranks' document attention: math keeps each document's softmax probabilities "
                        "(memory quadratic in its length, the CPU demo's memory pressure); flash runs torch's "
                        "CPU flash kernel, as megatron-core's masked attention already does (linear memory, "
                        "several times faster on long documents); GPUs use transformer-engine either way")
    g.add_argument("--dcp-exchange", choices=["targeted", "allgather"], default="targeted",
                   help="pull/push: each rank moves only the slices it needs, or the all-gather baseline")

    loop_flags.add_loop_flags(p)  # the training loop's and checkpoints' upstream flags
    add_model_flags(p)
    sft_flags.add_sft_flags(p)
    add_upstream_flags(p)  # last: upstream's flags we do not define, refused or accepted with a reason
    return allow_negative_numbers(p)


def use_pretrained_checkpoint(args) -> None:
    """Upstream's `--pretrained-checkpoint DIR`: while `--load` holds no checkpoint (or is not
    given) the run starts from DIR's weights, as `--load DIR --finetune` (iteration 0, no
    optimizer or RNG state); once `--load` holds one, it resumes from that, as upstream."""
    from megatron.training.checkpoint.protocol import TRACKER, holds_checkpoint

    pretrained = args.pretrained_checkpoint
    if not pretrained or holds_checkpoint(args.load):
        return
    if not holds_checkpoint(pretrained):
        raise ArgumentError(f"--pretrained-checkpoint {pretrained}: no checkpoint there (no {TRACKER}); point it to "
                            "the folder that holds the tracker file")
    args.load, args.finetune = pretrained, True


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse Megatron flags (and --yaml-cfg), fill derived values, validate for `world_size`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_flags(build_parser(), argv, "see pretrain_gpt_dcp.py --help")
    flag_refusals.check(args)  # every refused flag of the line at once, before any other check
    if world_size is None:
        world_size = world_size_from_env(os.environ)
    args.world_size = world_size
    use_pretrained_checkpoint(args)  # --pretrained-checkpoint: --load DIR --finetune while --load holds none
    loop_flags.apply_checkpoint_args(args)  # --use-checkpoint-args: model flags from --load's checkpoint
    check_ranges(args)  # before the derived values are computed from them (int(nan) would raise)
    loop_flags.check_schedule_forms(args)  # --train-samples vs --train-iters forms
    fill_derived(args)
    loop_flags.fill_loop_derived(args)  # train iterations from --train-samples
    validate_args(args)
    return args


def world_size_from_env(env) -> int:
    """WORLD_SIZE as torchrun sets it (1 without it), with RANK/LOCAL_RANK/MASTER_PORT checked:
    a hand-written launcher that sets them wrong gets one line, not a traceback or a hang."""
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        text = env.get(name)
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ArgumentError(f"environment variable {name}={text!r} is not an integer "
                                "(torchrun sets it; check your launcher)") from None
    world = values.get("WORLD_SIZE", 1)
    if world < 1:
        raise ArgumentError(f"environment variable WORLD_SIZE={world} must be >= 1")
    if "RANK" in values and not 0 <= values["RANK"] < world:
        raise ArgumentError(f"environment variable RANK={values['RANK']} is not in [0, WORLD_SIZE={world})")
    if "LOCAL_RANK" in values and values["LOCAL_RANK"] < 0:
        raise ArgumentError(f"environment variable LOCAL_RANK={values['LOCAL_RANK']} must be >= 0")
    if "MASTER_PORT" in values and not 0 < values["MASTER_PORT"] < 65536:
        raise ArgumentError(f"environment variable MASTER_PORT={values['MASTER_PORT']} is not a TCP port (1-65535)")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if world > 1 and missing:  # env:// rendezvous would fail with a traceback, or wait for nobody
        rank = f" and RANK={values['RANK']}" if "RANK" in values else ""
        raise ArgumentError(f"WORLD_SIZE={world}{rank} {'are' if rank else 'is'} set but {' and '.join(missing)} "
                            f"{'is' if len(missing) == 1 else 'are'} not: launch with torchrun (it sets them all), "
                            "or set MASTER_ADDR and MASTER_PORT to rank 0's address and a free port")
    return world


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30}


def memory_size(text) -> int:
    """`256MB`, `1.5GiB`, `80GB`, `1073741824` -> bytes (decimal MB/GB, binary MiB/GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write it like 256MB, 1.5GiB or 80GB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str], hint: str) -> argparse.Namespace:
    """Flags over --yaml-cfg values over the parser's defaults. Unknown flags are kept for
    `flag_refusals.check` (which `validate_args` runs first), to be said with the line's other
    refused flags in one line."""
    pre, _ = _yaml_only_parser().parse_known_args(argv)
    if pre.yaml_cfg:
        load_yaml_defaults(parser, pre.yaml_cfg)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        setattr(args, flag_refusals.UNKNOWN_ATTR, (unknown, hint, list(parser._option_string_actions)))
    return args


def _yaml_only_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--yaml-cfg", default=None)
    return p


def fill_derived(args: argparse.Namespace) -> None:
    """Megatron's derived defaults."""
    loop_flags.check_batch_schedule(args)  # its final size is --global-batch-size, before the default below
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.tokenizer_type is None and (args.vocab_file or args.merge_file):
        args.tokenizer_type = "GPT2BPETokenizer"  # upstream's pretrain_gpt.py default (its GPT-3 and sc21 scripts)
        args.tokenizer_type_defaulted = True
    sft_flags.fill_sft(args)
    if args.num_query_groups is not None:
        args.group_query_attention = True
    if not args.group_query_attention or args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        if args.swiglu:
            # Megatron keeps the parameter count of a 4h GELU MLP: 2/3 * 4h, multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None and args.hidden_size and args.num_attention_heads \
            and args.hidden_size % args.num_attention_heads == 0:
        # upstream derives it only from an even split (argument_checks refuses an uneven one
        # without an explicit --kv-channels: with RoPE it failed deep inside, with learned
        # positions it trained a model of other shapes than the flags said)
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.data_path and args.demo_corpus:
        args.demo_corpus = False  # given data wins over the demo's (examples/cpu_demo.yaml sets demo-corpus)
    if args.dcp_max_seq_len is None:
        args.dcp_max_seq_len = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None and args.lr_decay_iters:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.distributed_backend is None:
        import torch

        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    if args.bf16:
        # Megatron: bf16 accumulates and all-reduces gradients in fp32 unless told otherwise.
        args.accumulate_allreduce_grads_in_fp32 = not args.grad_reduce_in_bf16
    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // mp if mp and args.world_size % mp == 0 else None
    if args.global_batch_size is None and args.data_parallel_size:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size

"""Megatron-compatible command line for GPT jobs, plus the flags this fork adds.

Users bring their Megatron launch scripts: flag names, defaults and derived values follow
Megatron-LM's `arguments.py`. A YAML file (`--yaml-cfg`) may hold the same names as keys
(dashes or underscores); flags on the command line win. Every invalid combination ends
with one line that names the fix (see `validate_args`).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Optional, Sequence

from megatron.training import loop_flags


class ArgumentError(ValueError):
    """An invalid flag or combination; the message is one line that names the fix."""


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
                   help="build (once, cached) a corpus from this Python's standard library sources and train on it")
    g.add_argument("--tokenizer-type", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--data-cache-path", type=str, default=None)
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
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
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
    g.add_argument("--dcp-planner", choices=["adaptive", "static", "dynamic-cp", "dcp", "hydraulis"], default="adaptive")
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
    g.add_argument("--dcp-exchange", choices=["targeted", "allgather"], default="targeted",
                   help="pull/push: each rank moves only the slices it needs, or the all-gather baseline")
    from megatron.training.model_flags import add_model_flags
    from megatron.training.upstream_flags import add_upstream_flags

    loop_flags.add_loop_flags(p)  # the training loop's and checkpoints' upstream flags
    add_model_flags(p)
    add_upstream_flags(p)  # last: upstream's flags we do not define, refused or accepted with a reason
    return allow_negative_numbers(p)


def _dest_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def load_yaml_defaults(parser: argparse.ArgumentParser, path: str) -> None:
    import yaml

    if os.path.isdir(path):
        raise ArgumentError(f"--yaml-cfg {path}: is a directory, not a YAML file")
    if not os.path.isfile(path):
        raise ArgumentError(f"--yaml-cfg {path}: no such file")
    try:
        with open(path) as f:
            cfg = yaml.load(f, Loader=_unique_key_loader()) or {}
    except _DuplicateKey as e:
        raise ArgumentError(f"--yaml-cfg {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--yaml-cfg {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--yaml-cfg {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(cfg, dict):
        raise ArgumentError(f"--yaml-cfg {path}: expected a mapping of flag names to values")
    actions = _dest_names(parser)
    defaults, seen = {}, {}
    for key, value in cfg.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest == "yaml_cfg":
            raise ArgumentError(f"--yaml-cfg {path}: unknown key '{key}' (keys are flag names, e.g. num-layers)")
        if dest in seen:  # num-layers and num_layers are one flag
            raise ArgumentError(f"--yaml-cfg {path}: key '{key}' repeats '{seen[dest]}' (one value per flag)")
        seen[dest] = key
        defaults[dest] = _yaml_value(actions[dest], value, f"--yaml-cfg {path}: key '{key}'")
    parser.set_defaults(**defaults)


class _DuplicateKey(ValueError):
    pass


def _unique_key_loader():
    """yaml.SafeLoader that refuses a key given twice (PyYAML keeps the last one silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            keys = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in keys:
                    raise _DuplicateKey(f"key '{key}' appears twice (lines {keys[key]} and "
                                        f"{key_node.start_mark.line + 1}); one value per flag")
                keys[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return Loader


def _yaml_value(action: argparse.Action, value, where: str):
    """A YAML value checked and converted like the flag's command-line value would be."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ArgumentError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value.split() if isinstance(value, str) else value
        if action.nargs != "*" and not isinstance(items, (list, dict)) and items is not None:
            items = [items]  # one value for a one-or-more flag, as on the command line
        if not isinstance(items, list):
            raise ArgumentError(f"{where}: expected a list, got {value!r}")
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            raise ArgumentError(f"{where}: expected {action.nargs} values, got {len(items)}")
        if action.nargs == "+" and not items:
            raise ArgumentError(f"{where}: expected at least one value")
        return [_convert(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        raise ArgumentError(f"{where}: expected one value, got {value!r}")
    return None if value is None else _convert(action, value, where)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _convert(action: argparse.Action, value, where: str):
    convert = action.type or str
    if isinstance(value, bool):  # YAML reads yes/no/on/off/true/false as booleans: never a number or a name
        raise ArgumentError(f"{where}: expected {_TYPE_NAMES.get(convert, 'a value')}, got {str(value).lower()} "
                            "(YAML reads yes/no/on/off as true/false; quote it if you mean the word)")
    try:
        out = convert(str(value))
    except (TypeError, ValueError):
        name = getattr(convert, "__name__", "value")
        raise ArgumentError(f"{where}: invalid {name} value: {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ArgumentError(f"{where}: {out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse Megatron flags (and --yaml-cfg), fill derived values, validate for `world_size`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_flags(build_parser(), argv, "see pretrain_gpt_dcp.py --help")
    if world_size is None:
        world_size = world_size_from_env(os.environ)
    args.world_size = world_size
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
    return world


def parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str], hint: str) -> argparse.Namespace:
    """Flags over --yaml-cfg values over the parser's defaults; an unknown flag is one line."""
    pre, _ = _yaml_only_parser().parse_known_args(argv)
    if pre.yaml_cfg:
        load_yaml_defaults(parser, pre.yaml_cfg)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ArgumentError(f"unknown flag {unknown[0]} ({hint})")
    return args


def _yaml_only_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--yaml-cfg", default=None)
    return p


def fill_derived(args: argparse.Namespace) -> None:
    """Megatron's derived defaults."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
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
    if args.kv_channels is None and args.hidden_size and args.num_attention_heads:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
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


def check_files(args: argparse.Namespace) -> None:
    """Input files whose syntax is known before anything starts: the blend, the split, the profile."""
    from dcp_ext.data.documents import parse_blend, split_bookends
    from dcp_ext.data.errors import DataError

    try:
        if args.data_path:
            parse_blend(args.data_path)
        split_bookends(args.split)
    except DataError as e:
        raise ArgumentError(str(e)) from None
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
    dec, dec_min = getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    if dec_min is not None and dec is not None and dec_min > dec:
        raise ArgumentError(f"--decoupled-min-lr {_show(dec_min)} is above --decoupled-lr {_show(dec)}")


def validate_args(args: argparse.Namespace) -> None:
    """The whole configuration, in one place: required flags, ranges, YAML types (at load),
    relations between flags, and the syntax of input files named by flags."""
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ArgumentError(message)

    from megatron.training.upstream_flags import check_upstream_flags

    check_upstream_flags(args)  # first: a refused upstream flag is the answer, whatever else the line holds
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "lr"):
        need(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    need(args.train_iters is not None, "--train-iters (or --train-samples) is required")
    check_ranges(args)
    from megatron.training.model_flags import check_model_flags

    check_model_flags(args)  # before the relations below: it turns --sequence-parallel off at TP1, as upstream
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
        f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}",
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
    need(args.demo_corpus or args.mock_data or args.data_path, "--data-path is required (or --mock-data / --demo-corpus)")
    if args.recompute_granularity == "full":
        need(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        need(args.recompute_num_layers is not None,
             f"--recompute-granularity full needs --recompute-num-layers (1 to {args.num_layers // pp}, "
             "the layers per pipeline stage)")
    elif args.recompute_granularity == "selective":
        need(args.recompute_num_layers is None, "--recompute-num-layers applies to --recompute-granularity full, "
             "not selective")
    if args.lr_warmup_iters:
        need(args.lr_warmup_iters < (args.lr_decay_iters or 0),
             f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters {args.lr_decay_iters} "
             "(default: --train-iters)")
    need(args.log_interval > 0 and args.eval_interval > 0, "--log-interval and --eval-interval must be > 0")
    need(args.tensorboard_log_interval > 0 and args.tensorboard_queue_size > 0,
         "--tensorboard-log-interval and --tensorboard-queue-size must be > 0")
    need(not (args.use_distributed_optimizer and args.optimizer == "sgd"), "--use-distributed-optimizer needs --optimizer adam")
    if args.lr_decay_style == "WSD":
        need(args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
             "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)")
    loop_flags.validate_loop_flags(args)
    check_files(args)

"""Megatron's training-loop and checkpoint flags: definitions, derived values, checks.

Why a module of its own: the static loop (`training.train`) and the adaptive loop
(`training_adaptive.AdaptiveRun`) honour the same upstream flags (sample-based schedules,
decoupled LR, exit conditions, profiling, checkpoint contents), so their parsing and
validation live here once; the parser (`arguments`) and its checks (`argument_checks`)
call in with one line per hook.
Runtime behaviour is in `loop_features`.
"""
from __future__ import annotations

import argparse
import importlib.util
import signal

from megatron.training.checkpoint import protocol as ckpt
from megatron.training.flags.argument_errors import ArgumentError
from megatron.training.checkpoint.inspector import load_common_or_explain

CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")  # upstream's choices; we write torch_dist
SIGNAL_NAMES = tuple(s.name for s in signal.Signals)


def add_loop_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training loop (Megatron)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples: --train-iters = train-samples // --global-batch-size and the LR "
                        "schedule counts samples. Under --dcp an iteration is one global batch of tokens and counts as "
                        "--global-batch-size samples for the schedule")
    g.add_argument("--step-batch-size-schedule", type=str, nargs="+", default=None, metavar="THRESHOLD:SIZE",
                   help="upstream's step-wise global batch size: \"0:16 2.4B:320 ...\" (thresholds in tokens trained, "
                        "suffixes K/M/B/T); quoted or as separate words. --global-batch-size, if given, must be "
                        "its final size (upstream refuses the two together)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="own LR for the input embedding and output layer (min LR: --decoupled-min-lr)")
    g.add_argument("--decoupled-min-lr", type=float, default=None)
    g.add_argument("--manual-gc", action="store_true", help="disable Python's automatic GC; collect every "
                   "--manual-gc-interval iterations (0: never) and around evaluation")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: no collection around evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="torch.cuda.empty_cache after each step (1) and after the optimizer too (2); no-op on CPU")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop after this many minutes since the process started (all ranks agree), saving first "
                        "if --save (fractions of a minute accepted)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (SIGTERM: SLURM preemption) every rank finishes its iteration, saves if "
                        "--save, and exits 0")
    g.add_argument("--exit-signal", type=str, default="SIGTERM", choices=SIGNAL_NAMES, metavar="SIGNAL")
    g.add_argument("--log-throughput", action="store_true",
                   help="show 'throughput per GPU (TFLOP/s/GPU)' in the iteration line (model FLOPs, causal "
                        "attention per document)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="1: forward-backward/optimizer times at each log line; 2: also per-micro-batch compute "
                        "(under --dcp: the adaptive step as one timer)")
    g.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"])
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end (torch profiler; on CUDA "
                        "without --use-pytorch-profiler: an nsys capture range, as upstream)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[], help="default: every rank")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="trace to <--tensorboard-dir>/torch_profile/rank-N.json.gz (./torch_profile without it)")
    g.add_argument("--wandb-project", type=str, default=None, help="log the TensorBoard scalars to wandb too")
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None, help="default: <--save>/wandb")
    g.add_argument("--no-save-optim", action="store_true", help="checkpoints without optimizer and LR-schedule state")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints without RNG state")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model-shape flags from the checkpoint in --load (as upstream)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, train with the flags' LR schedule where it differs from the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, keep the checkpoint's LR schedule where it differs from the flags' (without "
                        "either flag a difference stops the resume, as upstream)")
    g.add_argument("--ckpt-format", type=str, default="torch_dist", choices=CKPT_FORMATS,
                   help="only torch_dist is written and read here")


def check_schedule_forms(args) -> None:
    """Before derived values: the sample and iteration forms of the schedule exclude each other
    (upstream's rule), and the sample counts are in range."""
    for name in ("train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples",
                 "manual_gc_interval", "profile_step_start", "profile_step_end"):
        value = getattr(args, name)
        if value is not None and value < (1 if name in ("train_samples", "lr_decay_samples") else 0):
            bound = ">= 1" if name in ("train_samples", "lr_decay_samples") else ">= 0"
            raise ArgumentError(f"--{name.replace('_', '-')} {value} must be {bound}")
    if args.train_samples is not None:
        for flag, given in (("--train-iters", args.train_iters is not None),
                            ("--lr-decay-iters", args.lr_decay_iters is not None),
                            ("--lr-warmup-iters", bool(args.lr_warmup_iters)),
                            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters is not None)):
            if given:
                raise ArgumentError(f"--train-samples and {flag} are mutually exclusive: use the sample forms "
                           "(--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples) or the iteration forms")
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive: give one")
    else:
        for flag, given in (("--lr-decay-samples", args.lr_decay_samples is not None),
                            ("--lr-warmup-samples", bool(args.lr_warmup_samples)),
                            ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples is not None)):
            if given:
                raise ArgumentError(f"{flag} needs --train-samples (sample-based training); with --train-iters use "
                           f"{flag.replace('samples', 'iters')}")
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
            raise ArgumentError("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive: give one")


def check_batch_schedule(args) -> None:
    """--step-batch-size-schedule: parsed into `args.batch_schedule` (None without it); its final
    size becomes --global-batch-size (the evaluation batch, and an iteration's samples for the LR
    schedule of --train-iters), which a user may also give when it is that size. First thing of
    `arguments.fill_derived` (before --global-batch-size's default)."""
    from megatron.training.loop.batch_schedule import BatchSchedule, ScheduleError, parse

    args.batch_schedule = None
    if args.step_batch_size_schedule is None or not args.seq_length:
        return
    value = args.step_batch_size_schedule
    text = value if isinstance(value, str) else " ".join(value)  # words as typed, or a string (stored args)
    try:
        schedule = BatchSchedule(parse(text, args.seq_length))
    except ScheduleError as e:
        raise ArgumentError(f"--step-batch-size-schedule {e}") from None
    args.step_batch_size_schedule = text
    if args.global_batch_size is not None and args.global_batch_size != schedule.final_size:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} differs from --step-batch-size-schedule's "
                            f"final size {schedule.final_size}: drop --global-batch-size (the schedule sets every "
                            "iteration's size; upstream refuses the two together)")
    if args.dcp_global_batch_tokens is not None:
        raise ArgumentError("--dcp-global-batch-tokens and --step-batch-size-schedule both size the global batch: keep "
                            "one (under --dcp the schedule's sizes are budgets of size x --seq-length tokens)")
    args.global_batch_size = schedule.final_size
    args.batch_schedule = schedule


def fill_loop_derived(args) -> None:
    """After `fill_derived` (which knows --global-batch-size): train iterations from samples,
    and what one scheduler step counts (an iteration, or its samples). With a batch-size
    schedule the LR schedule always counts samples, as upstream's: a step is the iteration's
    batch size (the loops pass it), --lr-decay-iters/--lr-warmup-iters count --global-batch-size
    (the final size) per iteration."""
    schedule = args.batch_schedule
    args.lr_schedule_in_samples = args.train_samples is not None or schedule is not None
    args.lr_step_increment = 1
    if args.train_samples is not None and args.global_batch_size:
        args.train_iters = schedule.iterations_for(args.train_samples) if schedule is not None \
            else args.train_samples // args.global_batch_size
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        args.lr_step_increment = args.global_batch_size
    elif schedule is not None:
        args.lr_step_increment = args.global_batch_size


def scheduler_steps(args) -> dict:
    """OptimizerParamScheduler's step counts: iterations, or samples under --train-samples (or
    a batch-size schedule: upstream's iteration counts times --global-batch-size)."""
    if args.lr_schedule_in_samples and args.train_samples is None:
        gbs = args.global_batch_size
        decay = max(args.lr_decay_iters or 1, 1) * gbs
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None \
            else args.lr_warmup_iters * gbs
        return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=max(args.train_iters, 1) * gbs,
                    wsd_decay_steps=args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None)
    if args.lr_schedule_in_samples:
        decay = args.lr_decay_samples
        warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_samples
        return dict(lr_warmup_steps=warmup, lr_decay_steps=max(decay, 1), wd_incr_steps=max(args.train_samples, 1),
                    wsd_decay_steps=args.lr_wsd_decay_samples)
    return dict(lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(args.lr_decay_iters or 1, 1),
                wd_incr_steps=max(args.train_iters, 1), wsd_decay_steps=args.lr_wsd_decay_iters)


def refusals(args) -> list:
    """[(flags, line)] for the loop and checkpoint flags given with a value this fork cannot honour."""
    out = []
    if args.ckpt_format != "torch_dist":
        out.append((["--ckpt-format"], f"--ckpt-format {args.ckpt_format} is not supported: this fork writes and reads "
                    "torch_dist (megatron.core.dist_checkpointing); pass --ckpt-format torch_dist or drop the flag"))
    return out


def validate_loop_flags(args) -> None:
    """The loop and checkpoint flags' relations; one line naming the fix."""
    schedule = args.batch_schedule
    if schedule is not None and not args.dcp:
        step = args.micro_batch_size * args.data_parallel_size
        bad = [size for size in schedule.sizes if size % step]
        if bad:
            raise ArgumentError(f"--step-batch-size-schedule size {bad[0]} is not divisible by micro-batch-size x "
                                f"data-parallel-size = {args.micro_batch_size} x {args.data_parallel_size}: change the "
                                "schedule or the layout (under --dcp any size is a token budget)")
    if schedule is not None and args.dcp and min(schedule.sizes) * args.seq_length < args.dcp_max_seq_len:
        raise ArgumentError(f"--step-batch-size-schedule size {min(schedule.sizes)} x --seq-length {args.seq_length} "
                            f"tokens is below --dcp-max-seq-len {args.dcp_max_seq_len}: a global batch must hold one "
                            "pack; raise the smallest size or lower --dcp-max-seq-len")
    if args.train_samples is not None:
        if args.train_iters < 1:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                       f"(--global-batch-size {args.global_batch_size}): raise it")
        warmup = scheduler_steps(args)["lr_warmup_steps"]
        if warmup and warmup >= args.lr_decay_samples:
            raise ArgumentError(f"the LR warmup ({warmup:g} samples) must be shorter than --lr-decay-samples "
                       f"{args.lr_decay_samples} (default: --train-samples)")
    if args.decoupled_min_lr is not None:
        if args.decoupled_lr is None:
            raise ArgumentError("--decoupled-min-lr needs --decoupled-lr (the embedding/output layer's peak LR)")
        if args.decoupled_min_lr > args.decoupled_lr:
            raise ArgumentError(f"--decoupled-min-lr {args.decoupled_min_lr:g} is above --decoupled-lr {args.decoupled_lr:g}")
    if args.decoupled_lr is not None and args.decoupled_lr < 0:
        raise ArgumentError(f"--decoupled-lr {args.decoupled_lr:g} must be >= 0")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ArgumentError(f"--exit-duration-in-mins {args.exit_duration_in_mins:g} must be > 0")
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise ArgumentError(f"--profile-step-end {args.profile_step_end} must be after --profile-step-start "
                   f"{args.profile_step_start}")
    if args.profile_ranks and any(r < 0 or r >= args.world_size for r in args.profile_ranks):
        raise ArgumentError(f"--profile-ranks {' '.join(map(str, args.profile_ranks))}: ranks are 0 to {args.world_size - 1}")
    for _, line in refusals(args):  # said with the line's other refused flags (flag_refusals) first
        raise ArgumentError(line)
    if args.wandb_project is None and (args.wandb_exp_name or args.wandb_save_dir):
        raise ArgumentError("--wandb-exp-name/--wandb-save-dir have no effect without --wandb-project: add it or drop them")
    if args.wandb_project is not None:
        if importlib.util.find_spec("wandb") is None:
            raise ArgumentError("--wandb-project needs the wandb package: pip install wandb, or drop --wandb-project/"
                       "--wandb-exp-name/--wandb-save-dir")
        if not (args.wandb_save_dir or args.save):
            raise ArgumentError("--wandb-project needs --wandb-save-dir DIR (or --save, for <save>/wandb)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each "
                            "other: the flags' LR schedule or the checkpoint's, pick one")
    if args.use_checkpoint_args and not args.load:
        raise ArgumentError("--use-checkpoint-args needs --load DIR (the checkpoint to read the model flags from)")


# Model-shape flags taken from the checkpoint, as upstream's load_args_from_checkpoint: the
# first kind only when not given, the forced kind always. Under our flag names.
_IF_UNSET = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "kv_channels",
             "max_position_embeddings", "vocab_size", "tokenizer_type")
_FORCED = ("num_query_groups", "group_query_attention", "position_embedding_type", "use_rotary_position_embeddings",
           "rotary_base", "rotary_percent", "rotary_interleaved", "disable_bias_linear", "add_qkv_bias", "swiglu",
           "squared_relu", "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
           "norm_epsilon", "qk_layernorm", "attention_dropout", "hidden_dropout", "make_vocab_size_divisible_by")


def apply_checkpoint_args(args) -> None:
    """--use-checkpoint-args: the model-shape flags from --load's checkpoint (before validation).
    The parallel layout stays this run's (our checkpoints load under any layout)."""
    if not args.use_checkpoint_args or not args.load:
        return
    try:
        iteration = ckpt.read_tracker(args.load)
        path = ckpt.find_checkpoint(args.load, iteration) if iteration is not None else None
        if path is None:
            raise ArgumentError(f"--use-checkpoint-args: no complete checkpoint in --load {args.load} to read the model "
                       "flags from")
        saved = load_common_or_explain(path).get("args")
    except ckpt.CheckpointError as e:
        raise ArgumentError(f"--use-checkpoint-args: {e}") from None
    if saved is None:
        raise ArgumentError(f"--use-checkpoint-args: {path} holds no arguments")
    for name in _IF_UNSET + _FORCED:
        value = getattr(saved, name, None)
        if not hasattr(args, name) or value is None:
            continue
        if name in _FORCED or getattr(args, name) is None:
            setattr(args, name, value)

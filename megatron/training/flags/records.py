"""The door: the checked flags become the records their consumers own.

Why it exists: below this point nothing reads the argparse namespace (issue 39). Each
builder here runs once, after `parse_args` has validated the line and the vocabulary is
padded, and fills one frozen record defined by the package that uses it. The `--dcp`
run's records (engine, planner, the planner's model) are built in `adaptive/run_config`.
"""
from __future__ import annotations

import os

from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.protocol import plain_values
from megatron.training.checkpoint.resume_checks import compared_flags
from megatron.training.flags.core_configs import (ddp_config_from_args, optimizer_config_from_args,
                                                  transformer_config_from_args)
from megatron.training.loop.batch_schedule import GlobalBatchSizes
from megatron.training.loop.batches import Packing
from megatron.training.loop.log import LogConfig
from megatron.training.loop.loop_features import FeatureOptions, WandbOptions
from megatron.training.loop.memory_report import budget_bytes
from megatron.training.loop.run import LoopConfig
from megatron.training.startup.preflight import OutputPath
from megatron.training.static.training_static import StaticOptions


def checkpoint_config_for(args) -> CheckpointConfig:
    """What saving and loading need of this run (`checkpoint.config`)."""
    model = tuple((name, getattr(args, name)) for name in compared_flags(args.position_embedding_type)
                  if hasattr(args, name))
    return CheckpointConfig(
        save=args.save, load=args.load,
        save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
        load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, finetune=bool(args.finetune),
        verify=not args.no_verify_checkpoint, exit_on_missing=bool(args.exit_on_missing_checkpoint),
        override_scheduler=bool(args.override_opt_param_scheduler),
        use_checkpoint_scheduler=bool(args.use_checkpoint_opt_param_scheduler),
        adaptive=bool(args.dcp),
        layout=(args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.context_parallel_size),
        distributed_optimizer=bool(args.use_distributed_optimizer), mixed_precision=bool(args.bf16 or args.fp16),
        padded_vocab_size=getattr(args, "padded_vocab_size", None), vocab_divisor=args.make_vocab_size_divisible_by,
        vocab_size=args.vocab_size, swiglu=bool(args.swiglu), model_flags=model,
        stored_flags=tuple(plain_values(args).items()))


def loop_config_for(args) -> LoopConfig:
    """The loop's iteration, evaluation, save and exit rules (`loop.run`)."""
    return LoopConfig(train_iters=args.train_iters, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                      save_interval=args.save_interval, saving=bool(args.save), exit_interval=args.exit_interval,
                      max_nan_iterations=args.max_nan_iterations)


def memory_budget_for(args) -> tuple[int, str] | None:
    """The memory budget the end-of-run report checks the peaks against (`loop.memory_report`)."""
    return budget_bytes(args.dcp_device_memory, args.dcp_device_memory_gb)


def log_config_for(args) -> LogConfig:
    """The iteration log, the --loss-log file, TensorBoard and W&B scalars (`loop.log`)."""
    shape = dict(num_layers=args.num_layers, hidden=args.hidden_size, ffn_hidden=args.ffn_hidden_size,
                 num_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                 kv_channels=args.kv_channels,
                 vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size or 0, swiglu=args.swiglu)
    return LogConfig(train_iters=args.train_iters, log_interval=args.log_interval, loss_log=args.loss_log,
                     tensorboard_dir=args.tensorboard_dir, tensorboard_queue_size=args.tensorboard_queue_size,
                     tensorboard_log_interval=args.tensorboard_log_interval,
                     log_timers_to_tensorboard=bool(args.log_timers_to_tensorboard),
                     log_validation_ppl_to_tensorboard=bool(args.log_validation_ppl_to_tensorboard),
                     log_throughput=bool(args.log_throughput), wandb=bool(args.wandb_project),
                     model_shape=tuple(shape.items()))


def feature_options_for(args) -> FeatureOptions:
    """Upstream's per-iteration services: exits, GC, timers, profiler, W&B (`loop.loop_features`)."""
    wandb = None
    if args.wandb_project:
        wandb = WandbOptions(project=args.wandb_project, exp_name=args.wandb_exp_name,
                             save_dir=args.wandb_save_dir or os.path.join(args.save, "wandb"),
                             config=tuple(plain_values(args).items()))
    return FeatureOptions(
        adaptive=bool(args.dcp), exit_signal=args.exit_signal if args.exit_signal_handler else None,
        exit_duration_in_mins=args.exit_duration_in_mins, saving=bool(args.save), manual_gc=bool(args.manual_gc),
        manual_gc_interval=args.manual_gc_interval, manual_gc_eval=bool(args.manual_gc_eval),
        empty_unused_memory_level=args.empty_unused_memory_level, timing_log_level=args.timing_log_level,
        timing_log_option=args.timing_log_option, log_interval=args.log_interval, profile=bool(args.profile),
        profile_ranks=tuple(args.profile_ranks or ()), profile_step_start=args.profile_step_start,
        profile_step_end=args.profile_step_end, use_pytorch_profiler=bool(args.use_pytorch_profiler),
        tensorboard_dir=args.tensorboard_dir, num_workers=args.num_workers or 0, wandb=wandb)


def batch_sizes_for(args) -> GlobalBatchSizes:
    """Each iteration's global batch size (`loop.batch_schedule`)."""
    return GlobalBatchSizes(args.global_batch_size, args.batch_schedule)


def packing_for(args) -> Packing:
    """How the static path's micro-batches are packed (`loop.batches`); after the tokenizer."""
    return Packing(reset_attention_mask=bool(args.reset_attention_mask), eod=getattr(args, "eod_token", None),
                   sequence_parallel=bool(args.sequence_parallel))


def output_paths_for(args) -> tuple[OutputPath, ...]:
    """Every path the run writes, with the ranks that write it (`startup.preflight`)."""
    wanted = [OutputPath("--save", args.save, "dir"),  # every rank writes its shards
              OutputPath("--loss-log", args.loss_log, "file", writers="last"),  # the last rank logs
              OutputPath("--tensorboard-dir", args.tensorboard_dir, "dir", writers="last"),
              OutputPath("--dcp-log-plan", args.dcp_log_plan, "file", writers="first")]
    # the static data path caches its sample index there; --dcp only for the demo corpus
    if not args.dcp or args.demo_corpus:
        wanted.append(OutputPath("--data-cache-path", args.data_cache_path, "cache"))
    return tuple(p for p in wanted if p.path)


def model_parallel_for(args) -> dict:
    """megatron-core's static layout and group timeout (`initialize.initialize_model_parallel`)."""
    return dict(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                cp=args.context_parallel_size, timeout_minutes=args.distributed_timeout_minutes)


def static_options_for(args) -> StaticOptions:
    """The static layout's step kind (`static.training_static`); after the tokenizer."""
    return StaticOptions(
        **model_parallel_for(args), seed=args.seed, half=bool(args.fp16 or args.bf16),
        micro_batch_size=args.micro_batch_size, batch_sizes=batch_sizes_for(args), seq_length=args.seq_length,
        lr_schedule_in_samples=bool(args.lr_schedule_in_samples), eval_iters=args.eval_iters,
        eval_microbatches=args.num_microbatches, num_workers=args.num_workers or 0, packing=packing_for(args),
        checkpoint=checkpoint_config_for(args), model_config=transformer_config_from_args(args),
        ddp_config=ddp_config_from_args(args), optimizer_config=optimizer_config_from_args(args))

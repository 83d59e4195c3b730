"""The door: the checked flags become the records their consumers own.

Why it exists: below this point nothing reads the argparse namespace (issue 39). Each
builder here runs once, after `parse_args` has validated the line and the vocabulary is
padded, and fills one frozen record defined by the package that uses it. The `--dcp`
run's records (engine, planner, the planner's model) are built in `adaptive/run_config`.
"""
from __future__ import annotations

from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.checkpoint.protocol import plain_values
from megatron.training.checkpoint.resume_checks import compared_flags
from megatron.training.loop.memory_report import budget_bytes
from megatron.training.loop.run import LoopConfig


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
        adaptive=bool(getattr(args, "dcp", False)),
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

"""Megatron's config objects from the flags: the model's TransformerConfig, the optimizer's
config and the LR schedule (part of the flags' door).

Why it exists: both ways to train (megatron-core's static layout in `training.py`, the
adaptive runtime in `adaptive/training_adaptive.py`) build the same model, optimizer settings
and schedule from the same flags. megatron-core owns these records; the flags become them
here, once, and nothing below reads the flags again.
"""
from __future__ import annotations

import torch

from megatron.training.flags import loop_flags


def dtype_of(args) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.params_dtype, torch.float32)


def transformer_config_from_args(args, **overrides):
    """megatron-core TransformerConfig from Megatron flags."""
    from megatron.core.transformer import TransformerConfig

    recompute = {}
    if args.recompute_granularity:
        recompute = dict(
            recompute_granularity=args.recompute_granularity,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
        )
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype_of(args),
        pipeline_dtype=dtype_of(args),
        use_cpu_initialization=bool(args.use_cpu_initialization) or not torch.cuda.is_available(),
        # Packed (THD) micro-batches vary in length: pipeline stages exchange shapes first.
        variable_seq_lengths=bool(args.reset_attention_mask or args.dcp),
        moe_token_dispatcher_type="alltoall",
        deterministic_mode=not torch.cuda.is_available(),
        **recompute,
    )
    from megatron.training.flags.model_flags import config_fields

    # attention backend, fusions, loss kernel, zero-centred norms, qk norms, fp8
    kwargs.update(config_fields(args))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def optimizer_config_from_args(args):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype_of(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )


def ddp_config_from_args(args):
    """megatron-core DDP's settings for the static layout (fp32 main grads, overlaps, buckets)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )


def build_lr_scheduler(args, optimizer):
    """Megatron's OptimizerParamScheduler, stepped once per iteration by `args.lr_step_increment`
    (1, or the global batch's samples under --train-samples: the schedule then counts samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if loop_flags.scheduler_steps(args)["lr_warmup_steps"] else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_style="constant",
        **loop_flags.scheduler_steps(args),
        lr_wsd_decay_style="exponential" if args.lr_decay_style == "WSD" else None,
    )

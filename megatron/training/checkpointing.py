"""The static loop's checkpoints: model, optimizer, LR schedule and RNG state under the
TP/PP/DP layout of megatron-core, in Megatron's own format.

Why a module of its own: this is what `training.train` saves and resumes; the directory
protocol (tracker, crash-safe save) is `checkpoint_protocol`, the explanation of a
checkpoint that does not load is `checkpoint_inspector`, and the adaptive runtime's
checkpoints are `checkpointing_adaptive`. Because the format is sharded by global tensor
slices, a checkpoint saved under one layout loads under another.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from dcp_ext.compat import mcore_compat
from megatron.training.checkpoint_inspector import check_saved_parts, load_common_or_explain, load_or_explain
from megatron.training.checkpoint_protocol import (CHECKPOINT_VERSION, CheckpointError, _common_args,
                                                   resolve_load_dir, save_sharded_atomic)
from megatron.training.initialize import print_rank_0
from megatron.training.resume_checks import check_model_args, reconcile_lr_schedule


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout_signature(args) -> tuple:
    return (args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size)


def _rng_sharded_object():
    """Per-(pp, tp, cp) RNG state; DP ranks are replicas, as in Megatron."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, tp, cp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_context_parallel_world_size()
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank())
    return ShardedObject("rng_state", rng_state(), (pp, tp, cp), offset, replica_id=ps.get_data_parallel_rank())


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module under --bf16/--fp16): checkpoint keys are
    Megatron's (`decoder.layers...`), no wrapper prefix."""
    from megatron.core.transformer.module import Float16Module

    model = getattr(model, "module", model)
    return model.module if isinstance(model, Float16Module) else model


# Optimizer state in model space (one tensor per parameter), so it reshards across TP/PP/DP.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def save_checkpoint(args, iteration: int, consumed_samples: int, model, optimizer, scheduler) -> None:
    from megatron.training.finite_weights import refuse_nonfinite

    refuse_nonfinite(unwrap(model).parameters(), iteration, args.save)
    model_sd = unwrap(model).sharded_state_dict()
    state = {
        "args": _common_args(args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "layout": _layout_signature(args),
        "model": model_sd,
    }
    if not getattr(args, "no_save_optim", False):  # upstream: neither optimizer nor LR schedule
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not getattr(args, "no_save_rng", False):
        state["rng_state"] = _rng_sharded_object()
    save_sharded_atomic(args.save, iteration, state)


def load_checkpoint(args, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore model (always), optimizer, scheduler and RNG (unless told not to); returns
    (iteration, consumed samples) to continue from."""
    found = resolve_load_dir(args)
    if found is None:
        return 0, 0
    path, _ = found
    common = load_common_or_explain(path)
    if common.get("format") == "dcp-fixed-sharding/v1":
        raise CheckpointError(f"{path}: an adaptive-runtime checkpoint (saved with --dcp): resume it with --dcp, "
                              "or export it with tools/convert_dcp_checkpoint.py")
    check_model_args(common.get("args"), args, path)
    saved_vocab = getattr(common.get("args"), "padded_vocab_size", None)
    if saved_vocab is not None and saved_vocab != args.padded_vocab_size:
        tp = args.tensor_model_parallel_size
        hint = f"--make-vocab-size-divisible-by {saved_vocab // tp}" if saved_vocab % tp == 0 else "the saved padding"
        raise CheckpointError(f"{path}: vocabulary padded to {saved_vocab} rows, this run pads to "
                              f"{args.padded_vocab_size}: a different model; use {hint}")
    check_saved_parts(args, common, path)  # --no-save-optim/--no-save-rng checkpoints need --no-load-*
    same_layout = tuple(common.get("layout", ())) == _layout_signature(args)
    model_sd = unwrap(model).sharded_state_dict()
    request = {"model": model_sd}
    load_optim = not (args.no_load_optim or args.finetune)
    if load_optim:  # before any tensor is read
        schedule = reconcile_lr_schedule(args, scheduler, common["opt_param_scheduler"], path)
        print_rank_0("> " + schedule.line)
    if load_optim:
        mcore_compat.prepare_optimizer_for_load(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIMIZER_METADATA)
    load_rng = not (args.no_load_rng or args.finetune) and same_layout
    if load_rng:
        request["rng_state"] = _rng_sharded_object()
    state = load_or_explain(request, path)
    unwrap(model).load_state_dict(state["model"], strict=True)
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
        mcore_compat.finish_optimizer_load(optimizer)
        scheduler.load_state_dict(common["opt_param_scheduler"])
        schedule.apply()
    elif args.bf16 or args.fp16:
        # The fp32 master weights are copies, not views: refresh them from the loaded model
        # (Megatron's load_checkpoint does the same), or the first step would undo the load.
        optimizer.reload_model_params()
    if load_rng:
        set_rng_state(state["rng_state"])
    if args.finetune:
        iteration, consumed = 0, 0
    else:
        iteration, consumed = common["iteration"], common["consumed_train_samples"]
    print_rank_0(f"  loaded checkpoint from {path} at iteration {common['iteration']}"
                 + ("" if same_layout else " (resharded from another layout)"))
    return iteration, consumed

"""Checkpoints in Megatron's layout, torch_dist format, written atomically.

    {save}/latest_checkpointed_iteration.txt      -> "1200"
    {save}/iter_0001200/                           -> megatron.core.dist_checkpointing files

A save is written into `iter_XXXXXXX.incomplete/`, renamed to `iter_XXXXXXX/` once every
rank has finished, and only then named in the tracker file (itself replaced atomically).
A crash at any point therefore leaves the tracker naming a complete checkpoint. Because
the format is sharded by global tensor slices, a checkpoint saved under one TP/PP/DP
layout loads under another.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from dcp_ext import mcore_compat
from megatron.training.initialize import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the path and the fix."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fault_point(name: str) -> None:
    """Test hook: `DCP_FAULT_INJECT=<name>` kills the process here (crash-safety tests)."""
    if os.environ.get("DCP_FAULT_INJECT") == name:
        os._exit(17)


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def save_sharded_atomic(root: str, iteration: int, state: dict) -> None:
    """Collective: every rank calls it with its sharded state dict."""
    from megatron.core import dist_checkpointing

    final = checkpoint_dir(root, iteration)
    staging = final + ".incomplete"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    dist_checkpointing.save(state, staging)
    _fault_point("after_shards")
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):  # re-saving an iteration (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(staging, final)
        _fault_point("after_rename")
        _write_tracker(root, iteration)
    dist.barrier()
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}")


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


def _common_args(args) -> argparse.Namespace:
    keep = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
    return argparse.Namespace(**keep)


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module under --bf16/--fp16): checkpoint keys are
    Megatron's (`decoder.layers...`), no wrapper prefix."""
    from megatron.core.transformer.module import Float16Module

    model = getattr(model, "module", model)
    return model.module if isinstance(model, Float16Module) else model


# Optimizer state in model space (one tensor per parameter), so it reshards across TP/PP/DP.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def save_checkpoint(args, iteration: int, consumed_samples: int, model, optimizer, scheduler) -> None:
    model_sd = unwrap(model).sharded_state_dict()
    state = {
        "args": _common_args(args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "layout": _layout_signature(args),
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": _rng_sharded_object(),
    }
    save_sharded_atomic(args.save, iteration, state)


def resolve_load_dir(args) -> tuple[str, int] | None:
    """(directory, iteration) to resume from, None to start fresh; errors name the path."""
    iteration = read_tracker(args.load)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {args.load}: no {TRACKER} found (and --exit-on-missing-checkpoint is set)")
        print_rank_0(f"WARNING: no checkpoint in {args.load} ({TRACKER} missing); starting from scratch")
        return None
    path = checkpoint_dir(args.load, iteration)
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {args.load}: {TRACKER} names iteration {iteration} but {path} is missing or incomplete")
    return path, iteration


def load_or_explain(request: dict, path: str, **kwargs) -> dict:
    """dist_checkpointing.load, with a mismatch between checkpoint and model as one line."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(request, path, **kwargs)
    except (CheckpointingException, CheckpointException, KeyError, RuntimeError) as e:
        # torch wraps the per-rank failures: the innermost "...Exception: message" line says why
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        causes = [line.split(": ", 1)[1] for line in lines if ": " in line and line.split(": ", 1)[0].endswith(
            ("Exception", "Error"))]
        why = (causes[-1] if causes else lines[0] if lines else type(e).__name__)[:300]
        raise CheckpointError(f"{path} cannot be loaded into this model ({why}): check the model flags") from None


def load_checkpoint(args, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore model (always), optimizer, scheduler and RNG (unless told not to); returns
    (iteration, consumed samples) to continue from."""
    from megatron.core import dist_checkpointing

    found = resolve_load_dir(args)
    if found is None:
        return 0, 0
    path, _ = found
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("format") == "dcp-fixed-sharding/v1":
        raise CheckpointError(f"{path}: an adaptive-runtime checkpoint (saved with --dcp): resume it with --dcp, "
                              "or export it with tools/convert_dcp_checkpoint.py")
    saved_vocab = getattr(common.get("args"), "padded_vocab_size", None)
    if saved_vocab is not None and saved_vocab != args.padded_vocab_size:
        tp = args.tensor_model_parallel_size
        hint = f"--make-vocab-size-divisible-by {saved_vocab // tp}" if saved_vocab % tp == 0 else "the saved padding"
        raise CheckpointError(f"{path}: vocabulary padded to {saved_vocab} rows, this run pads to "
                              f"{args.padded_vocab_size}: a different model; use {hint}")
    same_layout = tuple(common.get("layout", ())) == _layout_signature(args)
    model_sd = unwrap(model).sharded_state_dict()
    request = {"model": model_sd}
    load_optim = not (args.no_load_optim or args.finetune)
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

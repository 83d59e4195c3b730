"""The static loop's checkpoints: model, optimizer, LR schedule and RNG state under the
TP/PP/DP layout of megatron-core, in Megatron's own format.

Why a module of its own: this is what `training.train` saves and resumes; the directory
protocol (tracker, crash-safe save) is `checkpoint_protocol`, the explanation of a
checkpoint that does not load is `checkpoint_inspector`, and the adaptive runtime's
checkpoints are `checkpointing_adaptive`. Because the format is sharded by global tensor
slices, a checkpoint saved under one layout loads under another.

Upstream Megatron-LM's checkpoints resume here too (`upstream_format`): its common state
keeps the consumed samples in `args`, its RNG state is a (pp, tp) grid of per-DP lists,
and its distributed optimizer state is in whatever format its `content_metadata` names
(upstream's default `dp_reshardable`: buffer-shaped, so only under the same TP/PP). Ours
write `args.consumed_train_samples` and `content_metadata` too, which upstream reads.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from dcp_ext.compat import mcore_compat
from megatron.training.checkpoint.inspector import check_saved_parts, load_or_explain, open_checkpoint
from megatron.training.checkpoint.protocol import CHECKPOINT_VERSION, CheckpointError, resolve_load_dir, save_sharded_atomic
from megatron.training.initialize import print_rank_0
from megatron.training.checkpoint.resume_checks import check_model_args, reconcile_lr_schedule


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


def _rng_sharded_object(upstream: bool = False):
    """Per-(pp, tp, cp) RNG state; DP ranks are replicas, as in Megatron. `upstream`: upstream
    Megatron-LM's layout, a (pp, tp) grid whose every entry is a list (one state per DP rank
    under --data-parallel-random-init, else one)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp, tp, cp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_context_parallel_world_size()
    if upstream:
        return ShardedObject("rng_state", [rng_state()], (pp, tp), (ps.get_pipeline_model_parallel_rank(),
                             ps.get_tensor_model_parallel_rank()),
                             replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank())
    return ShardedObject("rng_state", rng_state(), (pp, tp, cp), offset, replica_id=ps.get_data_parallel_rank())


def _restore_rng(saved, upstream: bool, path: str) -> None:
    """Set the RNG state loaded from the checkpoint; upstream's is a list per DP rank."""
    if upstream:
        from megatron.core import parallel_state as ps

        if not isinstance(saved, list) or not saved:
            print_rank_0(f"  note: {path}: its RNG state is not upstream's per-DP list; the RNG state is not restored")
            return
        saved = saved[ps.get_data_parallel_rank()] if len(saved) > 1 else saved[0]
    try:
        set_rng_state(saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # e.g. CUDA tracker states on a CPU run
        print_rank_0(f"  note: {path}: its RNG state cannot be restored here ({type(e).__name__}: "
                     f"{str(e)[:80]}); training continues from this run's seed")


def unwrap(model):
    """The GPTModel inside DDP (and Float16Module under --bf16/--fp16): checkpoint keys are
    Megatron's (`decoder.layers...`), no wrapper prefix."""
    from megatron.core.transformer.module import Float16Module

    model = getattr(model, "module", model)
    return model.module if isinstance(model, Float16Module) else model


# Optimizer state in model space (one tensor per parameter), so it reshards across TP/PP/DP.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# What a checkpoint records of how its sharded state dict was built (megatron-core's
# `content_metadata`, which upstream's loader reads to build the same one).
CONTENT_METADATA = {**OPTIMIZER_METADATA, "singleton_local_shards": False}


def save_checkpoint(config, iteration: int, consumed_samples: int, model, optimizer, scheduler) -> None:
    """Write iteration `iteration` to `config.save` (a CheckpointConfig). Collective."""
    from megatron.training.checkpoint.finite_weights import refuse_nonfinite

    refuse_nonfinite(unwrap(model).parameters(), iteration, config.save)
    model_sd = unwrap(model).sharded_state_dict()
    state = {
        # upstream's loader reads the consumed samples and the iteration in args
        "args": config.stored_args(consumed_train_samples=consumed_samples, iteration=iteration),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "layout": config.layout,
        "model": model_sd,
        "content_metadata": dict(CONTENT_METADATA),  # as dist_checkpointing.save(content_metadata=...) stores it
    }
    if config.save_optim:  # upstream without it: neither optimizer nor LR schedule
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if config.save_rng:
        state["rng_state"] = _rng_sharded_object()
    save_sharded_atomic(config.save, iteration, state)


def _adam_steps_from_param_groups(optimizer) -> None:
    """megatron-core 0.16 without apex/TE (torch Adam): a loaded distributed optimizer puts the
    checkpoint's iteration count into its param groups' 'step', but the buffer-shaped format
    (dp_reshardable) then overwrites each parameter's 'step' with the loading template's
    dummy value, and Adam's bias correction restarts. Take it from the param groups."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def upstream_format(common: dict) -> bool:
    """Written by upstream Megatron-LM's checkpointing.py: ours record their layout, and
    tools/convert_dcp_checkpoint.py's exports where they came from."""
    return "layout" not in common and "exported_from" not in common


def _saved_layout(common: dict) -> tuple:
    """(world size, tp, pp, cp) the checkpoint was saved under; upstream's from its args."""
    if not upstream_format(common):
        return tuple(common.get("layout", ()))  # an export has none: never the same layout (no RNG state)
    saved = common.get("args")
    return tuple(getattr(saved, name, None) for name in ("world_size", "tensor_model_parallel_size",
                                                        "pipeline_model_parallel_size", "context_parallel_size"))


def _content_metadata(common: dict) -> dict:
    """The metadata the checkpoint's sharded state dict was built with (megatron-core's
    content_metadata); checkpoints without it: ours are fully_reshardable, upstream's from
    before megatron-core 0.13 follow upstream's fallback."""
    saved = common.get("content_metadata")
    if saved is not None:
        return {k: v for k, v in saved.items() if k != "dp_cp_group"}
    if not upstream_format(common):
        return dict(OPTIMIZER_METADATA)
    saved = common.get("args")
    if not getattr(saved, "use_distributed_optimizer", False):
        return {}
    old = "fully_sharded_model_space" if getattr(saved, "ckpt_fully_parallel_save", False) else "dp_zero_gather_scatter"
    return {"distrib_optim_sharding_type": old}


def _check_optimizer_format(config, common: dict, metadata: dict, path: str) -> None:
    """A distributed optimizer's state saved in a buffer-shaped format (upstream's default
    dp_reshardable) loads only into the same buffers: same TP/PP, distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    kind = metadata.get("distrib_optim_sharding_type")
    if kind is None or kind in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return
    saved = common.get("args")
    way_out = "or resume with --no-load-optim (the optimizer state starts afresh)"
    if not config.distributed_optimizer:
        raise CheckpointError(f"{path}: its optimizer state is a distributed optimizer's in format '{kind}' "
                              f"(upstream's default without --dist-ckpt-optim-fully-reshardable); resume with "
                              f"--use-distributed-optimizer, {way_out}")
    for name, flag, ours in (("tensor_model_parallel_size", "--tensor-model-parallel-size", config.layout[1]),
                             ("pipeline_model_parallel_size", "--pipeline-model-parallel-size", config.layout[2])):
        theirs = getattr(saved, name, None)
        if theirs is not None and theirs != ours:
            raise CheckpointError(f"{path}: its optimizer state is in format '{kind}', which loads only under the "
                                  f"layout it was saved with: {flag} {theirs} (this run: {ours}); "
                                  f"resume with {flag} {theirs}, {way_out}")


def _consumed_samples(common: dict, path: str) -> int:
    """Ours keep it at the top level; upstream's only in args."""
    if "consumed_train_samples" in common:
        return common["consumed_train_samples"]
    consumed = getattr(common.get("args"), "consumed_train_samples", None)
    if consumed is None:
        raise CheckpointError(f"{path}: common.pt records no consumed_train_samples (neither at its top level nor "
                              "in its args): the data position cannot be resumed; use --finetune to start at "
                              "iteration 0 from its weights")
    return consumed


def load_checkpoint(config, model, optimizer, scheduler) -> tuple[int, int]:
    """Restore model (always), optimizer, scheduler and RNG (unless told not to) from
    `config.load` (a CheckpointConfig); returns (iteration, consumed samples) to continue from."""
    found = resolve_load_dir(config.load, config.exit_on_missing)
    if found is None:
        return 0, 0
    path = found.path
    if found.release:
        config = config.as_finetune()
    common = open_checkpoint(path, skip_verify=not config.verify)  # inspected and checksums verified
    from megatron.training.checkpoint.checkpointing_adaptive import is_adaptive, load_dcp_weights  # (issue 28)

    if is_adaptive(common):
        if config.loads_optimizer():
            raise CheckpointError(f"{path}: an adaptive-runtime checkpoint (saved with --dcp): resume it with --dcp, "
                                  "start from its weights with --finetune, or export it with "
                                  "tools/convert_dcp_checkpoint.py")
        load_dcp_weights(config, unwrap(model), path, common)
        if config.mixed_precision:
            optimizer.reload_model_params()
        return (0, 0) if config.finetune else (common["iteration"], common["consumed_train_samples"])
    check_model_args(common.get("args"), config.model_flags, path)
    saved_vocab = getattr(common.get("args"), "padded_vocab_size", None)
    if saved_vocab is not None and saved_vocab != config.padded_vocab_size:
        tp = config.tensor_parallel
        hint = f"--make-vocab-size-divisible-by {saved_vocab // tp}" if saved_vocab % tp == 0 else "the saved padding"
        raise CheckpointError(f"{path}: vocabulary padded to {saved_vocab} rows, this run pads to "
                              f"{config.padded_vocab_size}: a different model; use {hint}")
    check_saved_parts(config, common, path)  # --no-save-optim/--no-save-rng checkpoints need --no-load-*
    upstream = upstream_format(common)
    saved_layout = _saved_layout(common)
    same_layout = saved_layout == config.layout
    metadata = _content_metadata(common)
    model_sd = unwrap(model).sharded_state_dict(metadata=dict(metadata))
    request = {"model": model_sd}
    load_optim = config.loads_optimizer()
    if load_optim:  # before any tensor is read
        _check_optimizer_format(config, common, metadata, path)
        schedule = reconcile_lr_schedule(config, scheduler, common["opt_param_scheduler"], path)
        print_rank_0("> " + schedule.line)
    if load_optim:
        mcore_compat.prepare_optimizer_for_load(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=dict(metadata))
    # upstream restores RNG state under the same TP/PP (its grid); ours under the same layout
    same_grid = saved_layout[1:3] == config.layout[1:3] if upstream else same_layout
    load_rng = config.loads_rng() and same_grid
    if load_rng:
        request["rng_state"] = _rng_sharded_object(upstream)
    consumed = 0 if config.finetune else _consumed_samples(common, path)
    state = load_or_explain(request, path)
    unwrap(model).load_state_dict(state["model"], strict=True)
    if load_optim:
        with torch.no_grad():  # dp_reshardable copies into the fp32 main params, leaves that require grad
            optimizer.load_state_dict(state["optimizer"])
        mcore_compat.finish_optimizer_load(optimizer)
        _adam_steps_from_param_groups(optimizer)
        scheduler.load_state_dict(common["opt_param_scheduler"])
        schedule.apply()
    elif config.mixed_precision:
        # The fp32 master weights are copies, not views: refresh them from the loaded model
        # (Megatron's load_checkpoint does the same), or the first step would undo the load.
        optimizer.reload_model_params()
    if load_rng:
        _restore_rng(state["rng_state"], upstream, path)
    iteration = 0 if config.finetune else common["iteration"]
    print_rank_0(f"  loaded checkpoint from {path} at iteration {common['iteration']}"
                 + (" (written by upstream Megatron-LM)" if upstream else "")
                 + ("" if same_layout else " (resharded from another layout)"))
    return iteration, consumed

"""Checkpoints of the adaptive runtime: the fixed optimizer sharding, in model space.

Same Megatron layout and atomic protocol as the static loop's `checkpointing` (tracker
file, `iter_XXXXXXX/`, torch_dist: `checkpoint_protocol`). What is stored is layout-free:
for every canonical tensor (the full model's parameter names) its fp32 master value and
Adam moments, written once by the rank that owns the tensor's first element (gathered
tensor by tensor, so no rank holds the whole model). Loading reads the tensors in groups
and keeps, on every rank, the pieces of its shard, so a checkpoint saved on W ranks
resumes on any W'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training import checkpoint_protocol as ckpt
from megatron.training.checkpoint_inspector import check_saved_parts, load_common_or_explain, load_or_explain
from megatron.training.initialize import print_rank_0
from megatron.training.resume_checks import check_model_args, reconcile_lr_schedule

FORMAT = "dcp-fixed-sharding/v1"
KINDS = ("param", "exp_avg", "exp_avg_sq")


LOAD_GROUP = 1 << 26  # elements of canonical tensors read per dist_checkpointing.load call


def _groups(tensors, limit: int):
    """Consecutive tensors in groups of at most `limit` elements (a larger tensor alone).
    Every rank walks the same canonical order, so the groups' loads line up."""
    group, size = [], 0
    for t in tensors:
        if group and size + t.numel > limit:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.numel
    if group:
        yield group


def _key(kind: str, name: str) -> str:
    return f"dcp.{kind}.{name}"


def _sharded(key: str, tensor: torch.Tensor, replica_id: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)


def save(args, iteration: int, consumed_samples: int, engine, scheduler, planner_state: dict) -> None:
    from megatron.training.finite_weights import refuse_nonfinite

    refuse_nonfinite([engine.optimizer.master()], iteration, args.save)
    avg, avg_sq, step = engine.optimizer.moments()
    shards = {"param": engine.optimizer.master(), "exp_avg": avg, "exp_avg_sq": avg_sq}
    kinds = ("param",) if getattr(args, "no_save_optim", False) else KINDS  # weights only
    state = {}
    # tensor by tensor onto the rank that owns its first element: no rank ever holds the
    # whole model (a 7B model's master and moments are 84 GB)
    for t in engine.space.tensors.values():
        writer = engine.sharding.owner_of(t.offset)
        for kind in kinds:
            value = engine.gather_tensor(shards[kind], t, writer)
            if value is not None:
                state[_key(kind, t.name)] = _sharded(_key(kind, t.name), value.cpu(), replica_id=0)
    del avg, avg_sq, shards
    state.update({
        "args": ckpt._common_args(args),
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "format": FORMAT,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "adam_step": step,
        "planner_state": planner_state,
        "canonical": [(t.name, list(t.shape)) for t in engine.space.tensors.values()],
    })
    if kinds == KINDS:
        state["opt_param_scheduler"] = scheduler.state_dict()
    ckpt.save_sharded_atomic(args.save, iteration, state)


def load(args, engine, scheduler, planner) -> tuple[int, int]:
    found = ckpt.resolve_load_dir(args)
    if found is None:
        return 0, 0
    path, _ = found
    common = load_common_or_explain(path)
    if common.get("format") != FORMAT:
        raise ckpt.CheckpointError(f"{path}: not an adaptive-runtime checkpoint (saved without --dcp); "
                                   "resume it without --dcp")
    check_model_args(common.get("args"), args, path)
    saved_rows = getattr(common.get("args"), "padded_vocab_size", None)
    if saved_rows is not None and saved_rows != args.padded_vocab_size:
        raise ckpt.CheckpointError(
            f"{path}: its vocabulary is padded to {saved_rows} rows, this run's to {args.padded_vocab_size} "
            f"(--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}, vocabulary "
            f"{getattr(args, 'vocab_size', None) or '?'}): resume with the flags it was trained with")
    saved = {name: tuple(shape) for name, shape in common["canonical"]}
    ours = {t.name: t.shape for t in engine.space.tensors.values()}
    if saved != ours:
        diff = sorted(set(saved.items()) ^ set(ours.items()))[:1]
        raise ckpt.CheckpointError(f"{path}: model shape differs from the checkpoint's (first difference: {diff})")
    check_saved_parts(args, common, path)
    schedule = None
    if not (args.no_load_optim or args.finetune) and "opt_param_scheduler" in common:
        schedule = reconcile_lr_schedule(args, scheduler, common["opt_param_scheduler"], path)
        print_rank_0("> " + schedule.line)
    sharding = engine.sharding
    kinds = KINDS if not (args.no_load_optim or args.finetune) else ("param",)
    shard = {kind: torch.zeros(sharding.shard_numel(engine.rank)) for kind in kinds}
    # in groups of tensors (the same groups on every rank: each load is collective), so a
    # rank holds at most ~LOAD_GROUP elements per kind at once; no rank is "the" main replica
    for group in _groups(list(engine.space.tensors.values()), LOAD_GROUP):
        request = {
            _key(kind, t.name): _sharded(_key(kind, t.name), torch.empty(t.shape), replica_id=engine.rank)
            for t in group for kind in kinds
        }
        state = load_or_explain(request, path, validate_access_integrity=False)
        for t in group:
            for piece, lo, hi in sharding.overlaps(engine.rank, t.offset, t.offset + t.numel):
                for kind in kinds:
                    values = state[_key(kind, t.name)].flatten()[lo - t.offset : hi - t.offset]
                    shard[kind][piece.offset + lo - piece.start : piece.offset + hi - piece.start] = values
        del state, request
    engine.optimizer.set_master(shard["param"])
    if "exp_avg" in shard:
        engine.optimizer.set_moments(shard["exp_avg"], shard["exp_avg_sq"], int(common["adam_step"]))
        scheduler.load_state_dict(common["opt_param_scheduler"])
        if schedule is not None:
            schedule.apply()
    dist.barrier()
    if args.finetune:
        return 0, 0
    planner.load_planning_state(common.get("planner_state") or {})  # with the calibration's windows
    print_rank_0(f"  loaded adaptive checkpoint from {path} at iteration {common['iteration']}")
    return common["iteration"], common["consumed_train_samples"]

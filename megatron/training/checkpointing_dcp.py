"""Checkpoints of the adaptive runtime: the fixed optimizer sharding, in model space.

Same Megatron layout and atomic protocol as `checkpointing` (tracker file,
`iter_XXXXXXX/`, torch_dist). What is stored is layout-free: for every canonical tensor
(the full model's parameter names) its fp32 master value and Adam moments, written once
by the rank that owns the tensor's first element. Loading takes, on every rank, the
tensors that overlap its shard, so a checkpoint saved on W ranks resumes on any W'.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training import checkpointing as ckpt
from megatron.training.initialize import print_rank_0

FORMAT = "dcp-fixed-sharding/v1"
KINDS = ("param", "exp_avg", "exp_avg_sq")


def _key(kind: str, name: str) -> str:
    return f"dcp.{kind}.{name}"


def _sharded(key: str, tensor: torch.Tensor, replica_id: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=replica_id)


def save(args, iteration: int, consumed_samples: int, engine, scheduler, planner_state: dict) -> None:
    avg, avg_sq, step = engine.optimizer.moments()
    full = {
        "param": engine.exchange.allgather(engine.optimizer.master()),
        "exp_avg": engine.exchange.allgather(avg),
        "exp_avg_sq": engine.exchange.allgather(avg_sq),
    }
    state = {}
    for t in engine.space.tensors.values():
        if engine.sharding.owner_of(t.offset) != engine.rank:
            continue
        for kind in KINDS:
            value = full[kind][t.offset : t.offset + t.numel].view(t.shape).clone()
            state[_key(kind, t.name)] = _sharded(_key(kind, t.name), value, replica_id=0)
    state.update({
        "args": ckpt._common_args(args),
        "checkpoint_version": ckpt.CHECKPOINT_VERSION,
        "format": FORMAT,
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "adam_step": step,
        "opt_param_scheduler": scheduler.state_dict(),
        "planner_state": planner_state,
        "canonical": [(t.name, list(t.shape)) for t in engine.space.tensors.values()],
    })
    ckpt.save_sharded_atomic(args.save, iteration, state)


def load(args, engine, scheduler, planner) -> tuple[int, int]:
    from megatron.core import dist_checkpointing

    found = ckpt.resolve_load_dir(args)
    if found is None:
        return 0, 0
    path, _ = found
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("format") != FORMAT:
        raise ckpt.CheckpointError(f"{path}: not an adaptive-runtime checkpoint (saved without --dcp); "
                                   "resume it without --dcp")
    saved = {name: tuple(shape) for name, shape in common["canonical"]}
    ours = {t.name: t.shape for t in engine.space.tensors.values()}
    if saved != ours:
        diff = sorted(set(saved.items()) ^ set(ours.items()))[:1]
        raise ckpt.CheckpointError(f"{path}: model shape differs from the checkpoint's (first difference: {diff})")
    sharding = engine.sharding
    needed = [t for t in engine.space.tensors.values()
              if any(True for _ in sharding.overlaps(engine.rank, t.offset, t.offset + t.numel))]
    kinds = KINDS if not (args.no_load_optim or args.finetune) else ("param",)
    request = {
        _key(kind, t.name): _sharded(_key(kind, t.name), torch.empty(t.shape), replica_id=engine.rank)
        for t in needed for kind in kinds
    }
    # each rank reads only the tensors its shard overlaps: no rank holds "the" main replica
    state = ckpt.load_or_explain(request, path, validate_access_integrity=False)
    shard = {kind: torch.zeros(sharding.shard_numel(engine.rank)) for kind in kinds}
    for t in needed:
        for piece, lo, hi in sharding.overlaps(engine.rank, t.offset, t.offset + t.numel):
            for kind in kinds:
                values = state[_key(kind, t.name)].flatten()[lo - t.offset : hi - t.offset]
                shard[kind][piece.offset + lo - piece.start : piece.offset + hi - piece.start] = values
    engine.optimizer.set_master(shard["param"])
    if "exp_avg" in shard:
        engine.optimizer.set_moments(shard["exp_avg"], shard["exp_avg_sq"], int(common["adam_step"]))
        scheduler.load_state_dict(common["opt_param_scheduler"])
    dist.barrier()
    if args.finetune:
        return 0, 0
    planner.load_state_dict(common.get("planner_state") or {})
    print_rank_0(f"  loaded adaptive checkpoint from {path} at iteration {common['iteration']}")
    return common["iteration"], common["consumed_train_samples"]

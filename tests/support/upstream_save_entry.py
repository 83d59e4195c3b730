"""pretrain_gpt_dcp.py whose static-path saves are laid out as upstream Megatron-LM's are.

Why it exists: a test of resuming an upstream checkpoint needs one, and upstream Megatron-LM
is not installed here. This wrapper replaces `checkpointing.save_checkpoint` with a writer
of upstream's `megatron/training/checkpointing.py` structure (torch_dist, upstream's
defaults): common state `args` (holding `consumed_train_samples`), `checkpoint_version`,
`iteration`, `num_floating_point_operations_so_far`, `rerun_state_machine`,
`opt_param_scheduler`, `content_metadata`; no top-level `consumed_train_samples`, no
`layout`; the RNG state a (pp, tp) grid of per-DP lists; the distributed optimizer's state
in `dp_reshardable` (upstream without --dist-ckpt-optim-fully-reshardable). Everything
else (training, the directory protocol) is the real entry point, unchanged.
"""
import copy
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from megatron.training import checkpointing  # noqa: E402
from megatron.training.checkpoint.protocol import common_args, save_sharded_atomic  # noqa: E402

UPSTREAM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                     "chained_optim_avoid_prefix": True}


def _rerun_state():
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)


def _upstream_rng():
    """upstream's get_rng_state for torch_dist: a (pp, tp) grid, each entry a list of states."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    grid = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    here = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [checkpointing.rng_state()], grid, here,
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def save_as_upstream(args, iteration, consumed_samples, model, optimizer, scheduler):
    from megatron.core import parallel_state as ps

    saved_args = common_args(args)
    saved_args.consumed_train_samples = consumed_samples
    saved_args.iteration = iteration
    metadata = dict(UPSTREAM_METADATA, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    model_sd = checkpointing.unwrap(model).sharded_state_dict(metadata=dict(metadata))
    state = {
        "args": saved_args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=dict(metadata)),
        "opt_param_scheduler": scheduler.state_dict(),
        "rerun_state_machine": _rerun_state(),
        "rng_state": _upstream_rng(),
        "num_floating_point_operations_so_far": 12345.0,
        "content_metadata": copy.deepcopy(UPSTREAM_METADATA),
    }
    save_sharded_atomic(args.save, iteration, state)


checkpointing.save_checkpoint = save_as_upstream
sys.argv[0] = os.path.join(REPO, "pretrain_gpt_dcp.py")
runpy.run_path(sys.argv[0], run_name="__main__")

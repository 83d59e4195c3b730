"""Quirks of the installed megatron-core version that are not about the CPU, in one place.

Each function names the version behaviour it works around, so an upgrade can delete it.
"""
from __future__ import annotations

import torch


def prepare_optimizer_for_load(optimizer) -> None:
    """megatron-core 0.16 `DistributedOptimizer.state_dict()` asserts that every param has
    a 'step' when neither apex nor TE is installed (torch Adam), which a freshly built
    optimizer lacks; building the loading sharded_state_dict calls it before it fills the
    dummy state itself. Fill the dummy state first (the load overwrites it)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init_dummy = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init_dummy is not None:
            init_dummy()


def finish_optimizer_load(optimizer) -> None:
    """megatron-core 0.16 `DistributedOptimizer.load_state_dict` without apex/TE gives every
    parameter's Adam state the SAME 'step' tensor; torch Adam then increments it once per
    parameter per step, so bias correction drifts after a resume. Give each its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if "step" in state and isinstance(state["step"], torch.Tensor):
                state["step"] = state["step"].clone()


def step_unless_gradients_nonfinite(optimizer) -> tuple[bool, float | None, int | None]:
    """megatron-core 0.16's `optimizer.step()` applies a step whose gradient norm is NaN or inf
    when nothing overflowed in half precision (fp32, bf16): it clips by the NaN norm and writes
    NaN into every weight. This is its own step (`ChainedOptimizer.step`: prepare the grads,
    one norm over every optimizer, clip each, count zeros, step), with the norm checked
    before anything is applied: a non-finite norm skips the step, as the adaptive runtime
    does. The norm is reduced over the model-parallel group, so every rank decides alike.
    Returns (applied, grad_norm, zeros in the grads or None), as `step()` does."""
    import math

    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    timers = getattr(optimizer.config, "timers", None)

    def timed(name):
        return timers(name, log_level=1) if timers is not None else None

    if optimizer.prepare_grads():  # fp16's scaler found an overflow (and backed off)
        return False, None, None
    timer = timed("optimizer-clip-main-grad")
    if timer is not None:
        timer.start(barrier=optimizer.config.barrier_with_L1_time)
    grad_norm = optimizer.get_grad_norm()
    finite = math.isfinite(float(grad_norm))
    if finite:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
                continue
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    if timer is not None:
        timer.stop()
    if not finite:
        return False, float(grad_norm), None
    zeros = optimizer.count_zeros() if optimizer.config.log_num_zeros_in_grad else None
    return optimizer.step_with_ready_grads(), grad_norm, zeros


_installed = False


def install() -> None:
    """Apply the patches below once (each only changes calls that would otherwise raise)."""
    global _installed
    if _installed:
        return
    _patch_fully_reshardable_optimizer_load()
    keep_checkpoint_writes_in_process()
    quiet_checkpoint_writer_errors()
    read_checkpoints_as_data_only()
    _installed = True


def quiet_checkpoint_writer_errors() -> None:
    """megatron-core 0.16's checkpoint writer logs a failed write (`logger.error`, which Python's
    last-resort handler prints on stderr) and then raises the same error, which the run reports
    as its one line: without a handler of its own the log record is a second, raw copy. A
    NullHandler on that one logger drops the copy; a user's logging config (root handlers)
    still receives it."""
    import logging

    log = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())


def keep_checkpoint_writes_in_process() -> None:
    """megatron-core 0.16 `FileSystemWriterAsync` (the torch_dist save strategy, used by
    synchronous saves too) collects its write results through a queue of a
    `multiprocessing.Manager` it starts on first use with the *spawn* method: a fresh Python
    per rank (seconds to start, ~300 MB) that lives until the rank exits normally. A rank
    that dies (SIGKILL, a crash mid-save, os._exit) leaves it running forever, reparented.
    A synchronous save puts and gets the results in the calling process itself, so an
    in-process queue does the same with no process at all. (An asynchronous save, which
    this fork never makes, would need the Manager's queue: it would fail loudly to pickle
    this one rather than misbehave.) Idempotent; called before every save."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def _patch_fully_reshardable_optimizer_load() -> None:
    """megatron-core 0.16, torch Adam (no apex/TE): a 'fully_reshardable' optimizer checkpoint
    stores param/exp_avg/exp_avg_sq per parameter, while torch Adam also keeps a per-param
    'step' (restored separately from param_groups). `_set_main_param_and_optimizer_states`
    copies every key of the live state and raises KeyError on 'step'. Keep the live value
    for keys the checkpoint does not carry."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            live = self.optimizer.state.get(main_param, {})
            tensors = {**{k: v for k, v in live.items() if k not in tensors}, **tensors}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def ensure_global_memory_buffer() -> None:
    """Sequence-parallel linears take scratch space from megatron-core's one global memory
    buffer, which only `initialize_model_parallel` creates; the adaptive runtime never
    calls it (no global layout), so create the buffer alone. It holds no layout state."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


# ------------------------------------------------ checkpoint files read as data only (issue 37)
# torch 2.6-2.13 and megatron-core 0.16 read three kinds of pickle from a torch_dist
# checkpoint; each is redirected to dcp_ext.compat.checkpoint_unpickler, which accepts data
# only. Everything that loads a checkpoint (both training paths, the inspector, the
# converter, the HF tools) goes through these three methods, so this is the one place.

def read_checkpoints_as_data_only() -> None:
    """Install the three redirects below (idempotent). Called by `install()` and by
    `megatron.training.checkpoint.inspector` before it reads a checkpoint."""
    _read_index_as_data()
    _read_stored_objects_as_data()
    _read_common_state_as_data()


def _read_index_as_data() -> None:
    """torch's `FileSystemReader.read_metadata` unpickles `.metadata` with plain
    `pickle.load` (any callable it names runs). Same method, restricted unpickler; megatron-core's
    CachedMetadataFileSystemReader calls it through `super()`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from dcp_ext.compat.checkpoint_unpickler import load_index

    if getattr(FileSystemReader.read_metadata, "_data_only", False):
        return

    def read_metadata(self, *args, **kwargs):
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(kwargs.get("rank"))
        else:  # torch before 2.7
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_index(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    read_metadata._data_only = True
    FileSystemReader.read_metadata = read_metadata


def _read_stored_objects_as_data() -> None:
    """torch's `DefaultLoadPlanner.load_bytes` (megatron-core's MCoreLoadPlanner inherits it)
    reads each object stored in a shard (ShardedObjects: the RNG state, upstream's optimizer
    parts) with `torch.load(weights_only=False)`. Same method, `weights_only=True`; a refusal
    names the shard file and the object's key."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from dcp_ext.compat.checkpoint_unpickler import load_torch_bytes

    if getattr(DefaultLoadPlanner.load_bytes, "_data_only", False):
        return

    def load_bytes(self, read_item, value):
        key = read_item.dest_index.fqn
        try:
            where = f"{self.metadata.storage_data[read_item.storage_index].relative_path}: {key}"
        except (AttributeError, KeyError, TypeError):
            where = key
        obj = load_torch_bytes(value, where)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj

    load_bytes._data_only = True
    DefaultLoadPlanner.load_bytes = load_bytes


def _read_common_state_as_data() -> None:
    """megatron-core 0.16 `TorchCommonLoadStrategy.load_common` reads `common.pt` with
    `torch.load` at its default, which is weights_only=True unless the environment says
    `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`. Same method, weights_only=True whatever the environment
    (the multi-storage client's path, which this fork does not use, is left as it is)."""
    import os

    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from megatron.core.msc_utils import MultiStorageClientFeature

    from dcp_ext.compat.checkpoint_unpickler import load_torch_file

    original = TorchCommonLoadStrategy.load_common
    if getattr(original, "_data_only", False):
        return

    def load_common(self, checkpoint_dir):
        if MultiStorageClientFeature.is_enabled():
            return original(self, checkpoint_dir)
        load_path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        try:
            return load_torch_file(load_path)
        except FileNotFoundError as e:
            raise CheckpointingException(f"Common file {load_path} does not exist") from e

    load_common._data_only = True
    TorchCommonLoadStrategy.load_common = load_common

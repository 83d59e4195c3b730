"""Checkpoints in Megatron's layout, torch_dist format, written crash-safely.

    {save}/latest_checkpointed_iteration.txt      -> "1200"
    {save}/iter_0001200/                           -> megatron.core.dist_checkpointing files

The tracker file is the commit point: a checkpoint exists once the tracker names it. A
save (rank 0 does every filesystem step; all ranks write their shards) goes:

    1. recover      leftovers of an interrupted save are put right (`recover`, below)
    2. stage        every rank writes into `iter_N.incomplete/`; fsync'd
    3. aside        re-saving an existing `iter_N`: rename it to `iter_N.old`
    4. rename       `iter_N.incomplete` -> `iter_N`
    5. tracker      write `latest_checkpointed_iteration.txt.tmp`, fsync, rename over the tracker
    6. delete old   rename `iter_N.old` -> `iter_N.deleting`, then remove that

with the directory fsync'd after every rename, so a crash (or power loss) between any two
steps leaves the tracker naming a complete checkpoint: the previous one up to step 5,
this one from then on (re-saving the iteration the tracker already names: the old copy up
to step 4, the new one from then on). What the loader does in each intermediate state
(`find_checkpoint`): a stale `.incomplete` or `.deleting` is never read; if the tracker
names iteration N but only `iter_N.old` exists (a re-save died between steps 3 and 4), it
loads `iter_N.old` (always a complete copy: it is only ever made by renaming a complete
`iter_N`, and is renamed away before its deletion starts); a `.old` next to its `iter_N` is
a finished re-save's leftover and is ignored. The loader never changes the directory (it
may be read-only); the next save's step 1 restores `iter_N.old` to `iter_N` when `iter_N`
is missing and removes the other leftovers. tests/test_save_faults.py kills a save at each
step in turn (`FAULT_POINTS`) and loads what is left. Because the format is sharded by
global tensor slices, a checkpoint saved under one TP/PP/DP layout loads under another.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from megatron.training.initialize import print_rank_0
from megatron.training.loop_features import check_saved_parts

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
STAGING_SUFFIX = ".incomplete"
ASIDE_SUFFIX = ".old"
DELETING_SUFFIX = ".deleting"

# Where `DCP_FAULT_INJECT=<name>` kills rank 0 in a save, in the order a save reaches them
# (tests/test_save_faults.py crashes at each in turn). "after_shards" kills every rank.
FAULT_POINTS = (
    "after_recover",      # step 1 done
    "after_staging_dir",  # empty iter_N.incomplete/ made
    "after_shards",       # every rank's shards in iter_N.incomplete/ (all ranks die here)
    "after_aside",        # re-save only: iter_N -> iter_N.old
    "after_rename",       # iter_N.incomplete -> iter_N
    "after_tracker_tmp",  # tracker .tmp written and fsync'd, not yet renamed
    "after_tracker",      # tracker names N: committed
    "after_mark_delete",  # re-save only: iter_N.old -> iter_N.deleting
    "mid_delete_old",     # re-save only: iter_N.deleting partly removed
    "after_delete_old",   # re-save only: iter_N.deleting gone
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names the path and the fix."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fault_point(name: str) -> None:
    """Test hook: `DCP_FAULT_INJECT=<name>` kills the process here (crash-safety tests)."""
    if os.environ.get("DCP_FAULT_INJECT") == name:
        os._exit(17)


def _fsync(path: str) -> None:
    """Flush a file, or the renames/creations inside a directory, to disk (best effort: a no-op
    where the path cannot be opened or the filesystem cannot sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)




def is_complete(path: str) -> bool:
    """A checkpoint directory dist_checkpointing finished writing (it writes metadata.json last)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "metadata.json"))


def find_checkpoint(root: str, iteration: int) -> str | None:
    """The complete directory holding `iteration` under `root`: `iter_N`, or `iter_N.old` when a
    re-save was interrupted between moving the old copy aside and moving the new one in."""
    final = checkpoint_dir(root, iteration)
    if is_complete(final):
        return final
    if not os.path.exists(final) and is_complete(final + ASIDE_SUFFIX):
        return final + ASIDE_SUFFIX
    return None


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
    _fault_point("after_tracker_tmp")
    os.replace(tmp, os.path.join(root, TRACKER))
    _fsync(root)


_ITER_DIR = re.compile(r"^iter_\d{7}$")


def recover(root: str) -> None:
    """Step 1 of a save (rank 0): put right what an interrupted save left in `root`.

    `iter_N.old` without `iter_N` is a complete copy moved aside by a re-save that died
    before its replacement moved in: rename it back (atomic; the loader reads either name).
    Every other leftover is garbage and removed: `iter_N.old` next to `iter_N` (a finished
    re-save's), `*.deleting` (a half-deleted one), `*.incomplete` (an unfinished staging),
    the tracker's .tmp.
    """
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(ASIDE_SUFFIX) and _ITER_DIR.match(name[: -len(ASIDE_SUFFIX)]):
            base = path[: -len(ASIDE_SUFFIX)]
            if not os.path.exists(base) and is_complete(path):
                os.rename(path, base)
                _fsync(root)
            else:
                shutil.rmtree(path, ignore_errors=True)
        elif name.endswith((STAGING_SUFFIX, DELETING_SUFFIX)) and _ITER_DIR.match(name.rsplit(".", 1)[0]):
            shutil.rmtree(path, ignore_errors=True)
    try:
        os.remove(os.path.join(root, TRACKER + ".tmp"))
    except FileNotFoundError:
        pass


def _fsync_tree(path: str) -> None:
    """Flush a staged checkpoint: its files (dist_checkpointing fsyncs the shards it writes;
    the small ones it may not) and its directories."""
    for d, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(d, name))
        _fsync(d)


def _remove_old(path: str) -> None:
    """Step 6: delete a replaced checkpoint (file by file, so a test can stop it halfway)."""
    first = True
    for d, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.remove(os.path.join(d, name))
            if first:
                _fault_point("mid_delete_old")
                first = False
        for name in dirs:
            os.rmdir(os.path.join(d, name))
    os.rmdir(path)


def save_sharded_atomic(root: str, iteration: int, state: dict) -> None:
    """Collective: every rank calls it with its sharded state dict. The one save protocol of
    both checkpoint kinds (module docstring: the steps and what a crash between them leaves)."""
    from megatron.core import dist_checkpointing

    mcore_compat.keep_checkpoint_writes_in_process()  # no writer process left behind by a crash
    final = checkpoint_dir(root, iteration)
    staging = final + STAGING_SUFFIX
    aside = final + ASIDE_SUFFIX
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        recover(root)
        _fault_point("after_recover")
        os.makedirs(staging)
        _fsync(root)
        _fault_point("after_staging_dir")
    dist.barrier()
    dist_checkpointing.save(state, staging)
    dist.barrier()
    if dist.get_rank() == 0:
        _fsync_tree(staging)
    _fault_point("after_shards")
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):  # re-saving an iteration (a relaunch of a finished job, a resume)
            os.rename(final, aside)
            _fsync(root)
            _fault_point("after_aside")
        os.rename(staging, final)
        _fsync(root)
        _fault_point("after_rename")
        _write_tracker(root, iteration)
        _fault_point("after_tracker")
        if os.path.exists(aside):
            doomed = final + DELETING_SUFFIX
            os.rename(aside, doomed)  # from here on nothing reads it: `.old` only ever names a complete copy
            _fsync(root)
            _fault_point("after_mark_delete")
            _remove_old(doomed)
            _fsync(root)
            _fault_point("after_delete_old")
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
    }
    if not getattr(args, "no_save_optim", False):  # upstream: neither optimizer nor LR schedule
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, metadata=OPTIMIZER_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not getattr(args, "no_save_rng", False):
        state["rng_state"] = _rng_sharded_object()
    save_sharded_atomic(args.save, iteration, state)


def resolve_load_dir(args) -> tuple[str, int] | None:
    """(directory, iteration) to resume from, None to start fresh; errors name the path."""
    iteration = read_tracker(args.load)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {args.load}: no {TRACKER} found (and --exit-on-missing-checkpoint is set)")
        print_rank_0(f"WARNING: no checkpoint in {args.load} ({TRACKER} missing); starting from scratch")
        return None
    path = find_checkpoint(args.load, iteration)
    if path is None:
        raise CheckpointError(f"--load {args.load}: {TRACKER} names iteration {iteration} but "
                              f"{checkpoint_dir(args.load, iteration)} is missing or incomplete")
    if path.endswith(ASIDE_SUFFIX):
        print_rank_0(f"  note: a re-save of iteration {iteration} was interrupted; loading its previous copy {path}")
    return path, iteration


# ---- what is wrong with a checkpoint that does not load (the inspector) -----------------------

COMMON_FILE = "common.pt"  # megatron.core's common (non-sharded) state
SHARD_INDEX = ".metadata"  # torch.distributed.checkpoint's index of every shard's bytes


def _damage_hint(path: str) -> str:
    """What to do about a damaged checkpoint: its earlier siblings, by name."""
    root = os.path.dirname(os.path.abspath(path))
    this = os.path.basename(os.path.abspath(path))
    try:
        others = sorted(n for n in os.listdir(root) if re.match(r"^iter_\d{7}$", n) and n != this
                        and is_complete(os.path.join(root, n)))
    except OSError:
        others = []
    where = f" (here: {', '.join(others[-3:])})" if others else ""
    return (f"restore it from a copy, or resume from an earlier checkpoint{where} by writing its iteration "
            f"into {os.path.join(root, TRACKER)}")


def inspect_checkpoint(path: str) -> None:
    """Raise CheckpointError naming the first file of checkpoint directory `path` that is
    missing or damaged: metadata.json, common.pt, the shard index (.metadata), or a shard
    file missing or shorter than the index says. Reads only the small files and the
    shards' sizes, so it runs before every load."""
    import json

    meta = os.path.join(path, "metadata.json")
    try:
        with open(meta) as f:
            info = json.load(f)
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is incomplete: metadata.json is missing (the save did not finish); "
                              + _damage_hint(path)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta} is damaged (not valid JSON: {str(e)[:80]}); {_damage_hint(path)}") from None
    backend = info.get("sharded_backend")
    if backend is not None and backend != "torch_dist":
        raise CheckpointError(f"{path} was saved in format {backend!r}; this fork reads torch_dist checkpoints")
    common = os.path.join(path, COMMON_FILE)
    if not os.path.isfile(common):
        raise CheckpointError(f"{path} is damaged: {COMMON_FILE} (iteration, arguments, scheduler) is missing; "
                              + _damage_hint(path))
    index = os.path.join(path, SHARD_INDEX)
    if not os.path.isfile(index):
        raise CheckpointError(f"{path} is damaged: {SHARD_INDEX} (the index of the shard files) is missing; "
                              + _damage_hint(path))
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # a damaged pickle raises anything from EOFError to ValueError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CheckpointError(f"{index} is damaged (cannot be read: {first}); {_damage_hint(path)}") from None
    need: dict[str, int] = {}
    for item in (storage or {}).values():
        name = getattr(item, "relative_path", None)
        if name is not None:
            need[name] = max(need.get(name, 0), int(item.offset) + int(item.length))
    for name in sorted(need):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise CheckpointError(f"{path} is damaged: shard file {name} is missing (one of {len(need)} that "
                                  f"{SHARD_INDEX} lists); {_damage_hint(path)}")
        size = os.path.getsize(shard)
        if size < need[name]:
            raise CheckpointError(f"{shard} is truncated ({size} bytes, {SHARD_INDEX} says at least {need[name]}): "
                                  f"the save was cut short or the copy is incomplete; {_damage_hint(path)}")


def load_common_or_explain(path: str) -> dict:
    """megatron.core's common state of checkpoint `path`, after the inspector; a failure names the file."""
    from megatron.core import dist_checkpointing

    from megatron.training.os_errors import explain_os_error

    inspect_checkpoint(path)
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # everything it reads is common.pt: whatever went wrong, that file is the cause
        os_line = explain_os_error(e)
        if os_line:
            raise CheckpointError(f"cannot read {os.path.join(path, COMMON_FILE)}: {os_line}") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise CheckpointError(f"{os.path.join(path, COMMON_FILE)} is damaged (cannot be read: {first}); "
                              + _damage_hint(path)) from None


_DAMAGE_WORDS = ("unpickl", "pickle data was truncated", "ran out of input", "eoferror", "invalid load key",
                 "pytorchstreamreader", "corrupt", "truncated", "unexpected end", "crc", "bad zip",
                 "weights only load failed")


def load_or_explain(request: dict, path: str, **kwargs) -> dict:
    """dist_checkpointing.load, with its failure as one line that names the cause: a file
    missing or damaged (the inspector), the operating system (a disk), or a checkpoint that
    does not match this model (the model flags)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.training.os_errors import exception_chain, explain_os_error

    try:
        return dist_checkpointing.load(request, path, **kwargs)
    except (CheckpointingException, CheckpointException, KeyError, RuntimeError, OSError, EOFError, ValueError) as e:
        os_line = explain_os_error(e)
        if os_line:
            raise CheckpointError(f"cannot read checkpoint {path}: {os_line}") from None
        inspect_checkpoint(path)  # a file missing or cut short is the cause, whatever the message said
        inner = exception_chain(e)
        missing = [x for x in inner if isinstance(x, FileNotFoundError)]
        if missing:
            raise CheckpointError(f"{path} is damaged: {missing[0].filename or missing[0]} is missing; "
                                  + _damage_hint(path)) from None
        # torch wraps the per-rank failures: the innermost "...Exception: message" line says why
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        causes = [line.split(": ", 1)[1] for line in lines if ": " in line and line.split(": ", 1)[0].endswith(
            ("Exception", "Error"))]
        why = (causes[-1] if causes else lines[0] if lines else type(e).__name__)[:300]
        text = (" ".join(f"{type(x).__name__} {x}" for x in inner) + " " + str(e)).lower()
        # bytes that do not decode (a shard of the right size, overwritten): not the model flags' fault
        if any(isinstance(x, (EOFError, OSError)) for x in inner) or any(w in text for w in _DAMAGE_WORDS):
            raise CheckpointError(f"{path} is damaged: a shard cannot be read ({why.split('. ')[0][:100]}); "
                                  + _damage_hint(path)) from None
        raise CheckpointError(f"{path} cannot be loaded into this model ({why}): check the model flags") from None


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

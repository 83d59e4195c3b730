"""What is wrong with a checkpoint that does not load, said in one line.

Why a module of its own: a resume that fails deep inside dist_checkpointing says nothing a
user can act on. Before and around every load (static and adaptive) these functions name
the file that is missing, damaged or cut short, the disk error, or the load flags a
checkpoint saved without its optimizer or RNG state needs, with what to do about it.
"""
from __future__ import annotations

import os
import re

from megatron.training.checkpoint_protocol import TRACKER, CheckpointError, is_complete
from megatron.training.os_errors import exception_chain, explain_os_error

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


def check_saved_parts(args, common: dict, path: str) -> None:
    """A checkpoint saved with --no-save-optim / --no-save-rng lacks those parts: the load must
    be told not to read them (upstream stops the same way), in one line."""
    saved = common.get("args")
    missing, flags = [], []
    load_optim = not (args.no_load_optim or args.finetune)
    if load_optim and getattr(saved, "no_save_optim", False):
        missing.append("optimizer state")
        flags.append("--no-load-optim")
    if not (args.no_load_rng or args.finetune) and getattr(saved, "no_save_rng", False) and not args.dcp:
        missing.append("RNG state")
        flags.append("--no-load-rng")
    if missing:
        raise CheckpointError(f"{path} was saved with {' '.join(f.replace('load', 'save') for f in flags)}: it has "
                              f"no {' and no '.join(missing)}; resume with {' '.join(flags)} (or --finetune)")

"""What is wrong with a checkpoint that does not load, said in one line.

Why a module of its own: a resume that fails deep inside dist_checkpointing says nothing a
user can act on. Before and around every load (static and adaptive) these functions name
the file that is missing, damaged or cut short, the disk error, or the load flags a
checkpoint saved without its optimizer or RNG state needs, with what to do about it.
`open_checkpoint` is the loaders' first read: this inspector, then every file against its
checksum (`checkpoint_checksums`), then the common state; a file that would run code when
read is refused by name wherever it is met (`dcp_ext.compat.checkpoint_unpickler`).
"""
from __future__ import annotations

import os
import re
import time

from dcp_ext.compat import mcore_compat
from dcp_ext.compat.checkpoint_unpickler import CodeRefused
from megatron.training.checkpoint.protocol import TRACKER, CheckpointError, is_complete
from megatron.training.startup.os_errors import exception_chain, explain_os_error

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
    shards' sizes, so it runs before every load. The pickled files are read as data only: one
    that would run code is refused (`CodeRefused`'s line, naming it)."""
    import json

    mcore_compat.read_checkpoints_as_data_only()  # whoever calls first (a tool, a loader)

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
    except CodeRefused as e:
        raise CheckpointError(str(e)) from None
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


def fallback_hint(path: str) -> str:
    """What to do about a damaged checkpoint: the previous complete iteration next to it, named."""
    from megatron.training.checkpoint.protocol import find_checkpoint

    folder = os.path.abspath(path)
    root = os.path.dirname(folder)
    m = re.match(r"^iter_(\d{7})(\.old)?$", os.path.basename(folder))
    try:
        names = os.listdir(root) if m else []
    except OSError:
        names = []
    this = int(m.group(1)) if m else 0
    earlier = sorted({int(n[5:12]) for n in names if re.match(r"^iter_\d{7}(\.old)?$", n)} - {this})
    found = [(n, find_checkpoint(root, n)) for n in earlier if n < this]
    found = [(n, where) for n, where in found if where is not None]
    if not found:
        return "restore it from a copy (there is no earlier complete checkpoint next to it)"
    n, where = found[-1]
    return (f"fall back to the previous complete checkpoint, iteration {n} ({where}): "
            f"echo {n} > {os.path.join(root, TRACKER)}; or restore this one from a copy")


def verify_checkpoint(path: str, skip: bool = False) -> None:
    """Check every file of checkpoint folder `path` against the checksums saved with it
    (`checkpoint_checksums`), before anything of it is used. Collective when a process group
    is up (the ranks share the files); every rank raises the same CheckpointError, naming the
    first file that differs and the checkpoint to fall back to. `skip`: --no-verify-checkpoint
    (one line says so); a checkpoint without checksums is loaded with one line saying so."""
    from megatron.training.checkpoint.checksums import CHECKSUM_FILE, ChecksumTableError, mismatches, read_checksums
    from megatron.training.initialize import print_rank_0

    if skip:
        print_rank_0(f"  note: --no-verify-checkpoint: the files of {path} are loaded without checking their "
                     "checksums")
        return
    try:
        files = read_checksums(path)
    except ChecksumTableError as e:
        raise CheckpointError(f"{e}: the checkpoint's files cannot be checked; {fallback_hint(path)}") from None
    if files is None:
        print_rank_0(f"  note: {path} has no {CHECKSUM_FILE} (saved before checkpoints carried checksums, or by "
                     "upstream Megatron-LM): its files are loaded unverified")
        return
    start = time.perf_counter()
    problems = mismatches(path, files)
    if problems:
        more = f" ({len(problems) - 1} more files differ)" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}; {fallback_hint(path)}")
    size = sum(f["bytes"] for f in files.values()) / 2**20
    print_rank_0(f"  verified {len(files)} files of {path} ({size:.1f} MiB) against their checksums in "
                 f"{time.perf_counter() - start:.2f} s")


def open_checkpoint(path: str, skip_verify: bool = False) -> dict:
    """A loader's first read of checkpoint folder `path`: the inspector, then every file against
    its checksum (collective under a process group; `skip_verify`: --no-verify-checkpoint),
    then its common state. Nothing of it is used before all three passed."""
    inspect_checkpoint(path)
    verify_checkpoint(path, skip=skip_verify)
    return load_common_or_explain(path, inspected=True)


def load_common_or_explain(path: str, inspected: bool = False) -> dict:
    """megatron.core's common state of checkpoint `path`, after the inspector; a failure names the file."""
    from megatron.core import dist_checkpointing

    if not inspected:
        inspect_checkpoint(path)
    try:
        return dist_checkpointing.load_common_state_dict(path)
    except CodeRefused as e:
        raise CheckpointError(str(e)) from None
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
    except (CheckpointingException, CheckpointException, KeyError, RuntimeError, OSError, EOFError, ValueError,
            CodeRefused) as e:
        refused = [x for x in exception_chain(e) if isinstance(x, CodeRefused)]
        if refused:  # an object inside a shard that would run code (any rank's): named from the folder on
            line = str(refused[0])
            raise CheckpointError(line if os.path.isabs(refused[0].path) else os.path.join(path, line)) from None
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


def check_saved_parts(config, common: dict, path: str) -> None:
    """A checkpoint saved with --no-save-optim / --no-save-rng lacks those parts: the load must
    be told not to read them (upstream stops the same way), in one line. `config`: the
    run's CheckpointConfig (the adaptive runtime keeps no RNG state in its checkpoints)."""
    saved = common.get("args")
    missing, flags = [], []
    if config.loads_optimizer() and getattr(saved, "no_save_optim", False):
        missing.append("optimizer state")
        flags.append("--no-load-optim")
    if config.loads_rng() and getattr(saved, "no_save_rng", False) and not config.adaptive:
        missing.append("RNG state")
        flags.append("--no-load-rng")
    if missing:
        raise CheckpointError(f"{path} was saved with {' '.join(f.replace('load', 'save') for f in flags)}: it has "
                              f"no {' and no '.join(missing)}; resume with {' '.join(flags)} (or --finetune)")

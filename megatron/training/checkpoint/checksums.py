"""Checksums of every file a checkpoint holds: written with each save, checked before a load.

Why it exists: a shard overwritten in place (a flipped bit on a disk, a bad copy, a
filesystem bug: 64 bytes changed, the size the same) still decodes, so it loaded with exit
code 0 and training went on from altered weights. Only files missing, cut short or
garbled were caught (`checkpoint_inspector`). Now:

- every save writes `checksums.json` into the checkpoint folder: the size and sha256 of
  every file in it (shards, `.metadata`, `common.pt`, `metadata.json`). Each rank hashes the
  shard files it wrote itself (`__<rank>_<n>.distcp`, still in its page cache), rank 0 the
  rest and writes the table, all before the folder is renamed into place and named in the
  tracker (`checkpoint_protocol.save_sharded_atomic`), so a crash never leaves a complete
  checkpoint without its checksums, nor checksums of files that were still being written;
- every load (both paths, and the converter and the HF export) reads each file once and
  compares, before any of it is used (`mismatches`): the ranks share the files, balanced by
  size, and agree on the result. `checkpoint_inspector.verify_checkpoint` says a mismatch in
  one line naming the file and the checkpoint to fall back to (the previous complete
  iteration in `--load`, when there is one); `--no-verify-checkpoint` skips the check (a
  store that guarantees integrity itself), said in one line; checkpoints without checksums
  (ours from before, upstream Megatron-LM's) load with one line saying they are unverified.

The checksums find damage, not tampering: whoever can rewrite a shard can rewrite the table.
That loading never runs code from a checkpoint is `dcp_ext.compat.checkpoint_unpickler`'s.
Standard library and torch.distributed only: the save protocol imports this module.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

import torch.distributed as dist

CHECKSUM_FILE = "checksums.json"
SCHEMA = "megatron-checkpoint-checksums/v1"
ALGORITHM = "sha256"
_BLOCK = 16 << 20  # bytes read per hash update
_RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # megatron-core's writer: each rank's own files


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- save
def _hasher_of(name: str, world: int) -> int:
    """The rank that hashes `name` at save: the rank that wrote it, else rank 0."""
    m = _RANK_SHARD.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def write_checksums(folder: str) -> None:
    """Collective, after every rank's shards are in `folder` (a staged checkpoint): hash each
    file and write `CHECKSUM_FILE` there (rank 0), fsync'd."""
    rank, world = _world()
    names = [sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))] if rank == 0 else [None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)  # rank 0's listing: every rank hashes from the same list
    names = [n for n in names[0] if n != CHECKSUM_FILE]
    mine = {n: {"bytes": os.path.getsize(os.path.join(folder, n)), ALGORITHM: file_digest(os.path.join(folder, n))}
            for n in names if _hasher_of(n, world) == rank}
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    if rank != 0:
        return
    files = {}
    for part in parts:
        files.update(part)
    table = {"schema": SCHEMA, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    path = os.path.join(folder, CHECKSUM_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_path(folder)  # the rename, on disk


def fsync_path(path: str) -> None:
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


# ----------------------------------------------------------------------------- load
class ChecksumTableError(ValueError):
    """CHECKSUM_FILE is there but is not a table this code wrote."""


def read_checksums(path: str) -> dict | None:
    """{file name: {"bytes": n, "sha256": hex}} recorded in checkpoint folder `path`; None
    when it has none (saved before checksums were written, or by upstream Megatron-LM)."""
    table_path = os.path.join(path, CHECKSUM_FILE)
    if not os.path.isfile(table_path):
        return None
    try:
        with open(table_path) as f:
            table = json.load(f)
        files = table["files"]
        if table.get("algorithm") != ALGORITHM or not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get(ALGORITHM), str)
                for v in files.values()):
            raise ValueError(f"not a {SCHEMA} table")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ChecksumTableError(f"{table_path} is damaged ({str(e)[:80]})") from None
    return files


def shares(files: dict, world: int) -> list[list[str]]:
    """The files each rank checks: largest first onto the least loaded rank (same on every rank)."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        r = loads.index(min(loads))
        out[r].append(name)
        loads[r] += files[name]["bytes"]
    return out


def _check(path: str, name: str, want: dict) -> str | None:
    """Why file `name` of `path` does not match its recorded checksum; None when it does."""
    full = os.path.join(path, name)
    try:
        size = os.path.getsize(full)
        if size != want["bytes"]:
            return f"{full} is damaged: it is {size} bytes, {want['bytes']} when it was saved"
        if file_digest(full) != want[ALGORITHM]:
            return f"{full} is damaged: its {ALGORITHM} differs from the one recorded when it was saved"
    except FileNotFoundError:
        return f"{full} is missing ({CHECKSUM_FILE} lists it)"
    except OSError as e:
        return f"{full} cannot be read ({e.strerror or e})"
    return None


def mismatches(path: str, files: dict) -> list[str]:
    """Collective when a process group is up: every file of `files` (read_checksums) checked
    once, the ranks sharing them; every rank returns the same sorted list of what differs."""
    rank, world = _world()
    problems = [p for p in (_check(path, n, files[n]) for n in shares(files, world)[rank]) if p]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = [p for part in everyone for p in part]
    return sorted(problems)

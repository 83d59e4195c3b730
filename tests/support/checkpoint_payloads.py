"""Hostile and damaged copies of a checkpoint, as an attacker or a bad disk would make them.

Why it exists: issue 37's probes, kept as code for the tests of both kinds of checkpoint
(tests/checkpoint/test_checkpoint_code.py, tests/checkpoint/test_checkpoint_checksums.py, the bad-input table).
Each payload runs a command when unpickled (it creates `marker`) and then returns the real
content, so a loader that executes it goes on as if nothing happened: the tests look for
the marker. `reseal` rewrites the checksum table after a change, as an attacker who can
write the files can, so that what refuses a payload is the data-only reader, not the
checksums.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil


class _Run:
    """Unpickles as eval(code): `os.system(...)` then the real object."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


def _then(marker: str, real: str) -> str:
    return f"(__import__('os').system('touch {marker}'), {real})[1]"


def iteration_dir(root: str) -> str:
    """The folder the tracker of checkpoint root `root` names."""
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(root, f"iter_{int(f.read().strip()):07d}")


def copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return iteration_dir(dst)


def poison_index(folder: str, marker: str) -> None:
    """`.metadata` that creates `marker` and then returns the real index."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        real = f.read()
    with open(path, "wb") as f:
        f.write(pickle.dumps(_Run(_then(marker, f"__import__('pickle').loads({real!r})"))))


def _torch_payload(marker: str, real: bytes) -> bytes:
    """torch.save bytes whose unpickling creates `marker` and returns torch.load(real)."""
    import torch

    buf = io.BytesIO()
    torch.save(_Run(_then(marker, f"__import__('torch').load(__import__('io').BytesIO({real!r}), "
                                  "weights_only=False)")), buf)
    return buf.getvalue()


def poison_common(folder: str, marker: str) -> None:
    """`common.pt` that creates `marker` and then returns the real common state."""
    path = os.path.join(folder, "common.pt")
    with open(path, "rb") as f:
        real = f.read()
    with open(path, "wb") as f:
        f.write(_torch_payload(marker, real))


def poison_stored_object(folder: str, marker: str, prefix: str = "") -> str:
    """The first object stored inside a shard whose key starts with `prefix` (megatron-core's
    ShardedObjects: the static path's RNG state, layers' extra state) replaced by a payload
    that creates `marker` and returns the real object: the payload is appended to the shard
    file and the index (plain data) points there. Returns its key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(os.path.join(folder, ".metadata"), "rb") as f:
        index = pickle.load(f)  # our own, unmodified index: safe to read in the test
    key = next(k for k, v in index.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and k.startswith(prefix))
    where = next(i for i in index.storage_data if i.fqn == key)
    info = index.storage_data[where]
    shard = os.path.join(folder, info.relative_path)
    with open(shard, "rb") as f:
        f.seek(info.offset)
        real = f.read(info.length)
    payload = _torch_payload(marker, real)
    with open(shard, "ab") as f:
        info.offset = f.seek(0, os.SEEK_END)
        f.write(payload)
    info.length = len(payload)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(index, f)
    return key


def flip(path: str, count: int = 64, at: float = 0.5) -> None:
    """Invert `count` bytes of `path` from `at` of its length on: its size stays the same."""
    data = bytearray(open(path, "rb").read())
    start = int(len(data) * at)
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    with open(path, "wb") as f:
        f.write(bytes(data))


def reseal(folder: str) -> None:
    """Rewrite the checksum table for the files as they are now (the code before issue 37
    wrote none: nothing to do there)."""
    try:
        from megatron.training.checkpoint.checksums import CHECKSUM_FILE, write_checksums
    except ImportError:
        return
    if os.path.exists(os.path.join(folder, CHECKSUM_FILE)):
        os.remove(os.path.join(folder, CHECKSUM_FILE))
        write_checksums(folder)

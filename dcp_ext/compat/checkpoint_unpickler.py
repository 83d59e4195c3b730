"""Reading a checkpoint's pickled files as data only: nothing in a checkpoint can run code.

Why it exists: torch's `FileSystemReader.read_metadata` reads a torch_dist checkpoint's
shard index (`iter_*/.metadata`) with plain `pickle.load`, and its load planner reads
every pickled object stored in the shards (`DefaultLoadPlanner.load_bytes`, megatron-core's
ShardedObjects such as the RNG state) with `torch.load(weights_only=False)`. A pickle can
name any callable, so a `.metadata` that runs a command and then returns the real index
ran it under `--load` and through every tool, which then went on as if nothing happened.
Checkpoints are shared between people and jobs: loading one must never execute anything.

What is here (the rules; `mcore_compat.read_checkpoints_as_data_only` installs them where
torch and megatron-core read these files, so the loader, the inspector and the tools share
them):

- `load_index`: the shard index through an unpickler that resolves only the exact types
  torch's checkpoint `Metadata` is made of (`INDEX_TYPES`: its dataclasses and enums,
  `torch.Size`, dtypes, layouts, memory formats, paths, plain containers) and megatron-core's two
  stand-in classes for older indexes; any other name is refused before it is imported;
- `load_torch_file` / `load_torch_bytes`: `common.pt` and the objects inside shards with
  `torch.load(weights_only=True)` (tensors, containers and the types megatron-core
  registers as safe), whatever `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` says;
- `CodeRefused`: what both raise for a file that would run code, naming the file and the
  callable it names; the loaders turn it into one `error:` line.

Standard library and torch only (no megatron): `dcp_ext` never imports `megatron.training`.
"""
from __future__ import annotations

import io
import pickle
import re

# The classes torch's checkpoint index is made of, by module (torch 2.6 - 2.13): the index
# itself, each tensor's and object's storage metadata, where each chunk lies in which file,
# and the save plans it keeps (`all_local_plans`). Names a torch version lacks are skipped.
INDEX_TYPES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),  # layouts pickle as _get_layout("torch.strided"): a table lookup
    # megatron-core's empty stand-ins for the index classes its 0.15 and older saves pickled
    "megatron.core.dist_checkpointing.strategies.torch": ("MCoreMetadata", "MCoreSavePlan"),
    # StorageMeta.checkpoint_id: torch's own writer records the folder as a path object
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
    # plain containers
    "collections": ("OrderedDict",),
    "builtins": ("set", "frozenset"),
}


class CodeRefused(pickle.UnpicklingError):
    """A checkpoint file refused because reading it would run code: it names a callable that
    is not one of the data types the file holds. Nothing from it was imported or called."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        super().__init__(f"{path}: refused: reading it would run code (it names {what}, which is not checkpoint "
                         "data); nothing from it was run. The file was tampered with or is not a checkpoint: "
                         "load this checkpoint only from a source you trust")

    def __reduce__(self):  # torch gathers a rank's failure to the others by pickling it
        return (type(self), (self.path, self.what))


def _resolve(module: str, name: str):
    import importlib

    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


_allowed: dict[tuple[str, str], object] | None = None


def allowed_globals() -> dict[tuple[str, str], object]:
    """{(module, name): object} the index unpickler resolves: INDEX_TYPES plus every dtype,
    layout and memory format torch defines (`torch.float32` pickles as the name 'float32')."""
    global _allowed
    if _allowed is None:
        import torch

        table = {}
        for module, names in INDEX_TYPES.items():
            for name in names:
                obj = _resolve(module, name)
                if obj is not None:
                    table[(module, name)] = obj
        for name in dir(torch):
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                table[("torch", name)] = obj
        _allowed = table
    return _allowed


class _IndexUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only `allowed_globals()`; no persistent ids."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self._path = path

    def find_class(self, module, name):
        obj = allowed_globals().get((module, name))
        if obj is None:
            raise CodeRefused(self._path, f"{module}.{name}")
        return obj

    def persistent_load(self, pid):
        raise CodeRefused(self._path, f"persistent id {str(pid)[:40]!r}")


def load_index(stream, path: str):
    """The checkpoint index pickled in `stream` (`path` names it in errors): torch's
    `Metadata`, or megatron-core's stand-in for an older one. Raises CodeRefused for a name
    outside the allow-list, pickle.UnpicklingError when what it holds is not an index."""
    index = _IndexUnpickler(stream, path).load()
    if not hasattr(index, "state_dict_metadata"):
        raise pickle.UnpicklingError(f"holds a {type(index).__name__}, not a checkpoint index")
    return index


def _refuse_if_code(source, path: str, error: BaseException) -> None:
    """After torch.load(weights_only=True) failed on `source`: CodeRefused when the file
    names callables outside torch's safe set (torch lists them without running anything),
    else nothing (the file is damaged, and the caller's error stands)."""
    import torch

    if not isinstance(error, pickle.UnpicklingError):
        return
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # not a torch.save file at all: damaged, not code
        unsafe = []
    if not unsafe:  # a name its static scan misses: torch's own refusal says which
        unsafe = re.findall(r"GLOBAL ([\w.]+)", str(error))
    if unsafe:
        raise CodeRefused(path, ", ".join(unsafe[:3])) from None


def load_torch_file(path: str, map_location="cpu"):
    """A torch.save file of a checkpoint (`common.pt`), as data only."""
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        _refuse_if_code(path, path, e)
        raise


def load_torch_bytes(value: io.BytesIO, where: str):
    """An object stored inside a shard (a megatron-core ShardedObject), as data only;
    `where` names it in errors ('<file>: <key>')."""
    import torch

    try:
        return torch.load(value, weights_only=True)
    except Exception as e:
        _refuse_if_code(value, where, e)
        raise


# ----------------------------------------------------------------- legacy checkpoints
# Upstream Megatron-LM's legacy format (`--ckpt-format torch`) is one torch.save file per
# model-parallel rank, `mp_rank_XX[_YYY]/model_optim_rng.pt`, holding the run's argparse
# Namespace next to the tensors. megatron-core registers the types it stores with torch's
# weights-only loader on import (argparse.Namespace, its enums, numpy RNG arrays, BytesIO);
# what another Megatron version stored beyond that is read as an inert record, never
# imported or called, if it is one of these plain data kinds; any other name is refused.
LEGACY_DATA_NAMES = frozenset({
    "argparse.Namespace",  # the run's arguments: attributes only (rebuilt without calling __init__)
    "types.SimpleNamespace",
    "_io.BytesIO",  # transformer-engine's `_extra_state` in older versions
    # numpy arrays of the RNG state (`np.random.get_state()`), under numpy 1 and 2 names
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
})
_NUMPY_DTYPE_CLASS = re.compile(r"^numpy\.dtypes\.\w+DType$")
_MEGATRON_ENUM = re.compile(r"^megatron\.[\w.]*\benums\.\w+$")  # megatron.core.transformer.enums.AttnBackend


class StoredRecord:
    """What a legacy checkpoint stored of a data type this reader does not import: the
    arguments it was rebuilt with (an enum's value) and its state. `name` is the type's
    dotted name in the file. Nothing of the named type runs."""

    name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<stored {self.name}{self.args!r}>"


def is_legacy_data_name(name: str) -> bool:
    """A dotted name a legacy checkpoint may hold as data (see LEGACY_DATA_NAMES)."""
    return name in LEGACY_DATA_NAMES or bool(_NUMPY_DTYPE_CLASS.match(name) or _MEGATRON_ENUM.match(name))


def _stand_in(name: str):
    if name == "argparse.Namespace":
        import argparse

        return argparse.Namespace
    return type(name.rsplit(".", 1)[-1], (StoredRecord,), {"name": name})


def load_legacy_file(path: str):
    """One `model_optim_rng.pt` of upstream's legacy format, as data only: torch.load with
    weights_only=True, allowed beyond torch's and megatron-core's safe types only the data
    names above (inert records). A file that names anything else is refused (CodeRefused)
    before it is read; nothing in it runs."""
    import torch

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip-format torch file: the load below says what it is
        unsafe = []
    refused = [name for name in unsafe if not is_legacy_data_name(name)]
    if refused:
        raise CodeRefused(path, ", ".join(refused[:3]))
    with torch.serialization.safe_globals([(_stand_in(name), name) for name in unsafe]):
        return load_torch_file(path)

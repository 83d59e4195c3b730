"""Checkpoints in Megatron's layout, torch_dist format, written crash-safely: the directory
protocol both checkpoint kinds share.

    {save}/latest_checkpointed_iteration.txt      -> "1200"
    {save}/iter_0001200/                           -> megatron.core.dist_checkpointing files

The tracker file is the commit point: a checkpoint exists once the tracker names it. A
save (rank 0 does every filesystem step; all ranks write their shards) goes:

    1. recover      leftovers of an interrupted save are put right (`recover`, below)
    2. stage        every rank writes into `iter_N.incomplete/`; fsync'd
    3. aside        re-saving an existing `iter_N`: rename it to `iter_N.old`
    4. rename       write `latest_checkpointed_iteration.txt.tmp` (fsync'd), then
                    `iter_N.incomplete` -> `iter_N`
    5. tracker      rename the tracker's .tmp over the tracker
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
is missing and removes the other leftovers.

No tracker at all (`resolve_load_dir`) is a fresh start only where nothing was committed:
no complete `iter_*` folder, or only the one a first save renamed into place before it
died (its tracker's .tmp, written before that rename, says so). Complete checkpoints with
no tracker mean the tracker was lost: refused, naming the newest and how to resume it,
never a fresh start that would save over them. A tracker saying `release` is upstream
Megatron's release checkpoint in `{load}/release/`: its weights load and the iteration
count starts at 0, as upstream does. tests/checkpoint/test_save_faults.py kills a save at each
step in turn (`FAULT_POINTS`) and loads what is left. Because the format is sharded by
global tensor slices, a checkpoint saved under one TP/PP/DP layout loads under another.

Why a module of its own: the static loop's checkpoints (`checkpointing`), the adaptive
runtime's (`checkpointing_adaptive`) and tools/convert_dcp_checkpoint.py write and find
checkpoints the same way; what each stores is theirs, the directory protocol is this one.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
from typing import NamedTuple

import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from megatron.training.checkpoint.checksums import fsync_path, write_checksums
from megatron.training.initialize import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
STAGING_SUFFIX = ".incomplete"
ASIDE_SUFFIX = ".old"
DELETING_SUFFIX = ".deleting"

# Where `DCP_FAULT_INJECT=<name>` kills rank 0 in a save, in the order a save reaches them
# (tests/checkpoint/test_save_faults.py crashes at each in turn). "after_shards" kills every rank.
FAULT_POINTS = (
    "after_recover",      # step 1 done
    "after_staging_dir",  # empty iter_N.incomplete/ made
    "after_shards",       # every rank's shards in iter_N.incomplete/ (all ranks die here)
    "after_aside",        # re-save only: iter_N -> iter_N.old
    "after_tracker_tmp",  # tracker .tmp written and fsync'd; iter_N not yet renamed into place
    "after_rename",       # iter_N.incomplete -> iter_N
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


def _tracker_text(root: str, name: str = TRACKER) -> str | None:
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def read_tracker(root: str) -> int | None:
    """The iteration the tracker names; None without a tracker. A `release` tracker is not an
    iteration (CheckpointError; `resolve_load_dir` loads it)."""
    text = _tracker_text(root)
    if text is None:
        return None
    path = os.path.join(root, TRACKER)
    if text == RELEASE:
        raise CheckpointError(f"{path} names a release checkpoint ({os.path.join(root, RELEASE)}), not an "
                              "iteration; load it with --load (training starts at iteration 0)")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def _stage_tracker(root: str, iteration: int) -> None:
    """Step 4's first half: the new tracker as .tmp, fsync'd (the commit renames it in)."""
    with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    fsync_path(root)


def _commit_tracker(root: str) -> None:
    os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
    fsync_path(root)


_ITER_DIR = re.compile(r"^iter_\d{7}$")
RELEASE = "release"


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
                fsync_path(root)
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
            fsync_path(os.path.join(d, name))
        fsync_path(d)


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
        fsync_path(root)
        _fault_point("after_staging_dir")
    dist.barrier()
    dist_checkpointing.save(state, staging)
    dist.barrier()
    write_checksums(staging)  # every file's size and sha256, in the folder before it can be committed
    if dist.get_rank() == 0:
        _fsync_tree(staging)
    _fault_point("after_shards")
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):  # re-saving an iteration (a relaunch of a finished job, a resume)
            os.rename(final, aside)
            fsync_path(root)
            _fault_point("after_aside")
        _stage_tracker(root, iteration)  # before the rename: marks an iter_N not yet committed
        _fault_point("after_tracker_tmp")
        os.rename(staging, final)
        fsync_path(root)
        _fault_point("after_rename")
        _commit_tracker(root)
        _fault_point("after_tracker")
        if os.path.exists(aside):
            doomed = final + DELETING_SUFFIX
            os.rename(aside, doomed)  # from here on nothing reads it: `.old` only ever names a complete copy
            fsync_path(root)
            _fault_point("after_mark_delete")
            _remove_old(doomed)
            fsync_path(root)
            _fault_point("after_delete_old")
    dist.barrier()
    print_rank_0(f"  successfully saved checkpoint at iteration {iteration:7d} to {root}")

def plain_values(namespace) -> dict:
    """The picklable plain values of a flags namespace: what common.pt stores as `args`."""
    return {k: v for k, v in vars(namespace).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}


def common_args(namespace) -> argparse.Namespace:
    """Megatron's `args` entry of common.pt for a namespace of flags (the tools' writers)."""
    return argparse.Namespace(**plain_values(namespace))



def _complete_iterations(root: str) -> dict[int, str]:
    """{iteration: complete folder} of the checkpoints in `root`, as `find_checkpoint` finds them."""
    found = {}
    for name in os.listdir(root):
        base = name[: -len(ASIDE_SUFFIX)] if name.endswith(ASIDE_SUFFIX) else name
        if _ITER_DIR.match(base):
            n = int(base[len("iter_"):])
            path = find_checkpoint(root, n)
            if path is not None:
                found[n] = path
    return found


def _without_tracker(load: str) -> str | None:
    """No tracker in `load`: None when nothing was committed there (a fresh start is right), else
    the line refusing to start afresh over the checkpoints it holds."""
    found = _complete_iterations(load) if os.path.isdir(load) else {}
    if not found:
        unfinished = sorted(n for n in os.listdir(load) if _ITER_DIR.match(n)) if os.path.isdir(load) else []
        if not unfinished:
            return None
        legacy = legacy_refusal("--load", load, os.path.join(load, unfinished[-1]))
        if legacy:
            return f"{legacy} (there is no {TRACKER}: add --iteration {int(unfinished[-1][len('iter_'):])} to the conversion)"
        return (f"--load {load}: {TRACKER} is missing and {load} holds {', '.join(unfinished[-3:])} but none is a "
                "complete checkpoint; to start from scratch point --load and --save to another directory, or remove "
                "those folders")
    staged = _tracker_text(load, TRACKER + ".tmp")
    if staged is not None and set(found) == {_int_or_none(staged)}:
        return None  # the first save died between its rename and its commit (step 4 of the protocol)
    newest = max(found)
    return (f"--load {load}: {TRACKER} is missing but {load} holds checkpoints (newest complete: "
            f"{os.path.basename(found[newest])}); to resume from it write its iteration into the tracker "
            f"(echo {newest} > {os.path.join(load, TRACKER)}), or to start from scratch point --load and --save to "
            "another directory")


# Upstream Megatron-LM's legacy format (`--ckpt-format torch`): one torch.save file per model-
# parallel rank, `{iter_N|release}/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt` (tensor, pipeline and
# expert rank; the pipeline part only with pipeline parallelism). This fork reads torch_dist only;
# tools/convert_legacy_checkpoint.py converts the weights.
LEGACY_FILE = "model_optim_rng.pt"
LEGACY_CONVERTER = "tools/convert_legacy_checkpoint.py"
_LEGACY_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def legacy_shards(folder: str) -> dict[tuple[int, int, int], str]:
    """{(tp rank, pp rank, expert rank): its folder} of the legacy-format rank folders in `folder`."""
    out = {}
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = _LEGACY_RANK_DIR.match(name)
            if m and os.path.isdir(os.path.join(folder, name)):
                out[tuple(int(g or 0) for g in m.groups())] = os.path.join(folder, name)
    return out


def legacy_description(folder: str) -> str | None:
    """What `folder` holds when it is a legacy-format checkpoint (None otherwise)."""
    shards = legacy_shards(folder)
    if not any(os.path.isfile(os.path.join(d, LEGACY_FILE)) for d in shards.values()):
        return None  # empty mp_rank_* folders: not a checkpoint of any format
    tp, pp = 1 + max(k[0] for k in shards), 1 + max(k[1] for k in shards)
    return (f"an upstream Megatron-LM checkpoint in its legacy format (--ckpt-format torch: {len(shards)} "
            f"mp_rank_*/{LEGACY_FILE} files, tensor-parallel {tp}, pipeline-parallel {pp})")


def legacy_refusal(flag: str, load: str, folder: str) -> str | None:
    """The line refusing a legacy-format checkpoint, with the command that converts it."""
    what = legacy_description(folder)
    if what is None:
        return None
    out = load.rstrip("/") + "_torch_dist"
    return (f"{flag} {load}: {folder} is {what}; this fork loads torch_dist checkpoints: convert its weights with "
            f"`python {LEGACY_CONVERTER} --load {load} --save {out}`, then train with --load {out} --finetune")


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


class LoadDir(NamedTuple):
    """Where a resume reads: the checkpoint folder, its iteration, and whether it is an
    upstream release checkpoint (loaded as `--finetune` is: weights only, from iteration 0)."""

    path: str
    iteration: int
    release: bool = False


def _release_dir(load: str) -> LoadDir:
    """A `release` tracker: upstream's release checkpoint in `{load}/release/`, loaded as upstream
    does (weights only, the iteration count from 0: `--finetune`'s rule), if it is a
    torch_dist checkpoint."""
    path = os.path.join(load, RELEASE)
    said = f"--load {load}: {TRACKER} says '{RELEASE}' (an upstream release checkpoint)"
    if not os.path.isdir(path):
        raise CheckpointError(f"{said} but {path} does not exist; point --load to the folder that holds it")
    if not is_complete(path):
        legacy = legacy_refusal("--load", load, path)
        if legacy:
            raise CheckpointError(legacy)
        raise CheckpointError(f"{said} but {path} is not a complete torch_dist checkpoint (no metadata.json); point "
                              "--load to a complete checkpoint")
    print_rank_0(f"  note: {load} holds a release checkpoint ({TRACKER} says '{RELEASE}'): loading its weights "
                 f"from {path}; training starts at iteration 0 without its optimizer or RNG state, as upstream "
                 "Megatron does")
    return LoadDir(path, 0, release=True)


def resolve_load_dir(load: str | None, exit_on_missing: bool = False) -> LoadDir | None:
    """Where to resume from (`--load`), None to start fresh; errors name the path.
    `exit_on_missing`: --exit-on-missing-checkpoint (no tracker is an error, not a fresh start)."""
    if _tracker_text(load) == RELEASE:
        return _release_dir(load)
    iteration = read_tracker(load)
    if iteration is None:
        refusal = _without_tracker(load)
        if refusal:
            raise CheckpointError(refusal)
        if exit_on_missing:
            raise CheckpointError(f"--load {load}: no {TRACKER} found (and --exit-on-missing-checkpoint is set)")
        staged = os.path.isfile(os.path.join(load, TRACKER + ".tmp"))
        why = (f"{TRACKER} missing: the first save was killed before its commit" if staged and
               _complete_iterations(load) else f"{TRACKER} missing")
        print_rank_0(f"WARNING: no checkpoint in {load} ({why}); starting from scratch")
        return None
    path = find_checkpoint(load, iteration)
    if path is None:
        legacy = legacy_refusal("--load", load, checkpoint_dir(load, iteration))
        if legacy:
            raise CheckpointError(legacy)
        raise CheckpointError(f"--load {load}: {TRACKER} names iteration {iteration} but "
                              f"{checkpoint_dir(load, iteration)} is missing or incomplete")
    if path.endswith(ASIDE_SUFFIX):
        print_rank_0(f"  note: a re-save of iteration {iteration} was interrupted; loading its previous copy {path}")
    return LoadDir(path, iteration)


def holds_checkpoint(root: str | None) -> bool:
    """Whether `root` has a tracker file (a checkpoint, or the trace of one, to resume from)."""
    return bool(root) and _tracker_text(root) is not None

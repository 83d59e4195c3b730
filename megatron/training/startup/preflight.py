"""Before training starts: every path the run will write can be written.

Without this, `--save` naming a file or a read-only directory is found at the first save,
after the whole interval's work, and a `--loss-log` in a missing folder at the first log
line. Each rank checks the paths it will write itself (the shards of `--save` are written by
every rank; `--loss-log` and `--tensorboard-dir` by the last, `--dcp-log-plan` by rank 0),
by creating, writing (64 KiB, fsync'd) and removing a probe file where the run will create
its files, so that what the OS says (no space, permission denied, read-only file system)
is what the line says. The ranks then agree (one all_gather), and if any path fails every
rank stops with the same one line: the flag, the path, the problem and the fix.

Nothing is created but the probe: a missing `--save`/`--tensorboard-dir`/`--data-cache-path`
directory is made later by the run as before (the check probes its nearest existing
parent), and an existing file is opened for appending, never written. An existing, non-empty
`--data-cache-path` that cannot be written is accepted: it may hold a prebuilt cache that
the run only reads.
"""
from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

from dcp_ext.cli.boundary import existing_ancestor, write_probe
from megatron.training.flags.argument_errors import ArgumentError



class OutputPathError(ArgumentError):
    """A path the run would write cannot be written; the message names flag, path, problem, fix."""


@dataclass(frozen=True)
class OutputPath:
    """One path the run writes: the flag that names it, the path, its kind ('dir': made if
    missing; 'file': appended to, its folder must exist; 'cache': a dir that may be a
    read-only prebuilt cache) and the ranks that write it ('every', 'first', 'last').
    The door builds them (`flags.records.output_paths_for`)."""

    flag: str
    path: str
    kind: str
    writers: str = "every"

    def written_by(self, rank: int, world_size: int) -> bool:
        return (self.writers == "every" or (self.writers == "first" and rank == 0)
                or (self.writers == "last" and rank == world_size - 1))


def paths_to_check(paths, rank: int, world_size: int) -> list[tuple[str, str, str]]:
    """(flag, path, kind) of the `paths` (OutputPath) this rank will write."""
    return [(p.flag, p.path, p.kind) for p in paths if p.written_by(rank, world_size)]


def os_problem_line(e: OSError, flag: str, what: str) -> tuple[str, str]:
    """(problem, fix) for an OS error, said as the OS means it."""
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied", f"point {flag} to a {what} this user can write, or fix its permissions"
    if e.errno == errno.EROFS:
        return "read-only file system", f"point {flag} to a writable file system"
    if e.errno == errno.ENOSPC:
        return "no space left on the device", f"free space there or point {flag} to another disk"
    if getattr(errno, "EDQUOT", None) == e.errno:
        return "disk quota exceeded", f"free space there or point {flag} to another disk"
    return (e.strerror or type(e).__name__).lower(), f"point {flag} elsewhere"


def check_dir(flag: str, path: str, cache: bool = False) -> str | None:
    """None if the run can create files in directory `path` (made if missing), else the line."""
    full = os.path.abspath(path)
    base = existing_ancestor(full)
    if not os.path.isdir(base):
        where = "is a file, not a directory" if base == full else f"{base} is a file, not a directory"
        return f"{flag} {path}: {where}: point {flag} to a directory"
    err = write_probe(base)
    if err is None:
        return None
    if cache and base == full and os.listdir(full):
        return None  # may be a prebuilt cache that the run only reads
    problem, fix = os_problem_line(err, flag, "directory")
    where = f"cannot create files in {base}" if base == full else f"cannot create {full} in {base}"
    return f"{flag} {path}: {problem} ({where}): {fix}"


def check_file(flag: str, path: str) -> str | None:
    """None if the run can append to file `path` (created if missing), else the line."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{flag} {path}: is a directory, not a file: give {flag} a file name"
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        base = existing_ancestor(folder)
        if os.path.lexists(base) and not os.path.isdir(base):
            return f"{flag} {path}: {base} is a file, not a folder: point {flag} to a file in an existing folder"
        return f"{flag} {path}: folder {folder} does not exist: create it (mkdir -p {folder}) or point {flag} elsewhere"
    if os.path.exists(full):
        if not os.path.isfile(full):
            return None  # /dev/null and friends: nothing to probe without writing
        try:
            os.close(os.open(full, os.O_WRONLY | os.O_APPEND))
        except OSError as e:
            problem, fix = os_problem_line(e, flag, "file")
            return f"{flag} {path}: {problem} (cannot append to it): {fix}"
        return None
    err = write_probe(folder)
    if err is None:
        return None
    problem, fix = os_problem_line(err, flag, "folder")
    return f"{flag} {path}: {problem} (cannot create files in {folder}): {fix}"


def check_paths(paths, rank: int = 0, world_size: int = 1) -> tuple[str | None, str | None, list[str]]:
    """(flag, line) of the first problem among the `paths` (OutputPath) this rank writes
    ((None, None) if all are fine), and the flags it checked."""
    checked = []
    for flag, path, kind in paths_to_check(paths, rank, world_size):
        checked.append(flag)
        problem = check_file(flag, path) if kind == "file" else check_dir(flag, path, cache=kind == "cache")
        if problem:
            return flag, problem, checked
    return None, None, checked


def check_output_paths(paths) -> None:
    """Collective when torch.distributed is up: every rank checks its paths, then all agree.
    Raises OutputPathError (the same line on every rank) if any path fails anywhere."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    flag, problem, checked = check_paths(paths, rank, world)
    if distributed and world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (flag, problem, checked, socket.gethostname()))
        failed = [(r, f, p, host) for r, (f, p, _, host) in enumerate(everyone) if p]
        if not failed:
            return
        r, flag, problem, host = failed[0]
        if any(flag in c and not p for f, p, c, _ in everyone):  # fine elsewhere: a node-local problem
            problem += f" (on rank {r}, host {host})"
    if problem:
        raise OutputPathError(problem)

"""Errors from the operating system (a full disk, a read-only or foreign directory), said as such.

Why: a save that meets a full disk surfaces as torch's `CheckpointException` (a
BaseException that wraps each rank's OSError with its traceback) or as a bare OSError from
wherever the write happened (a shard, the tracker, the data cache, a log). The user needs
one line: which file, and that the disk is full (or the path not writable), not a
traceback. `explain_os_error(e)` finds the OSError inside whatever was raised and returns
that line, or None when the failure was not the operating system's.
"""
from __future__ import annotations

import errno
import os
import re
from typing import Optional

_WHY = {
    errno.ENOSPC: "no space left on the disk",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error (a failing disk or a lost network filesystem)",
    errno.ENOTDIR: "a path component is a file, not a directory",
    errno.EISDIR: "it is a directory",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.EMFILE: "too many open files (raise ulimit -n)",
    errno.ENFILE: "too many open files in the system",
}
_FIX = {
    errno.ENOSPC: "free space there (or point the path elsewhere) and rerun; training resumes from the last checkpoint",
    errno.EDQUOT: "free space in your quota (or point the path elsewhere) and rerun",
    errno.EROFS: "point the path to a writable filesystem",
    errno.EACCES: "fix its permissions or point the path elsewhere",
    errno.EPERM: "fix its permissions or point the path elsewhere",
}


def find_os_error(e: BaseException, _depth: int = 0) -> Optional[OSError]:
    """The OSError that caused `e`: itself, a wrapped cause, or a rank's failure inside a
    torch.distributed.checkpoint CheckpointException."""
    if e is None or _depth > 8:
        return None
    if isinstance(e, OSError) and e.errno in _WHY:
        return e
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict):
        for item in failures.values():
            inner = item[0] if isinstance(item, tuple) else item
            if isinstance(inner, BaseException):
                found = find_os_error(inner, _depth + 1)
                if found is not None:
                    return found
    for inner in (e.__cause__, e.__context__):
        if inner is not None and inner is not e:
            found = find_os_error(inner, _depth + 1)
            if found is not None:
                return found
    return None


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:\n]+)(?:: '([^'\n]+)')?")


def exception_chain(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions inside it: torch's per-rank failures, causes and contexts."""
    out, todo = [], [e]
    while todo and len(out) < 16:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        todo += [x.__cause__, x.__context__]
    return [x for x in out if isinstance(x, BaseException)]


def _errno_in_text(e: BaseException) -> Optional[OSError]:
    """megatron-core's async writer re-raises a worker's OSError as RuntimeError("Worker failure:
    [Errno 28] No space left on device"): read the errno back from the message."""
    for x in exception_chain(e):
        m = _ERRNO_TEXT.search(str(x))
        if m and int(m.group(1)) in _WHY:
            return OSError(int(m.group(1)), m.group(2).strip(), m.group(3))
    return None


def full_disk_among(paths) -> Optional[tuple[str, str, int]]:
    """(flag, path, free bytes) of the first output path whose file system is (nearly) full."""
    for flag, path in paths:
        if not path:
            continue
        probe = os.path.abspath(path)
        while probe and not os.path.exists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        try:
            st = os.statvfs(probe)
        except OSError:
            continue
        free = st.f_bavail * st.f_frsize
        if free < FULL_BELOW_BYTES:
            return flag, path, free
    return None


FULL_BELOW_BYTES = 1 << 20  # less free than this, and a write failed: the disk is the cause


def explain_failure(e: BaseException, paths=()) -> Optional[str]:
    """explain_os_error, naming the full output disk when the error does not say which file;
    and for a failure that hides its cause (torch's zip writer says "unexpected pos" when a
    write came up short) while an output disk is full: that disk. `paths`: the run's outputs
    (preflight.OutputPath: flag, path)."""
    full = full_disk_among([(p.flag, p.path) for p in paths]) if paths else None
    where = None if full is None else f"{full[0]} {full[1]} ({full[2] // 1024} KiB free)"
    line = explain_os_error(e, where)
    if line is not None or full is None:
        return line
    inner = [x for x in exception_chain(e) if type(x).__name__ != "CheckpointException" and str(x).strip()]
    first = (str(inner[-1]).strip().splitlines()[0] if inner else type(e).__name__)[:120]
    return (f"no space left on the disk holding {where}: a write failed ({first}): free space there "
            f"(or point {full[0]} elsewhere) and rerun; training resumes from the last checkpoint")


def explain_os_error(e: BaseException, full_disk: Optional[str] = None) -> Optional[str]:
    """One line for an OS-level failure (None if `e` is not one): what, where, what to do.
    `full_disk`: the output path on a full disk, said when a no-space error names no file."""
    found = find_os_error(e) or _errno_in_text(e)
    if found is None:
        return None
    why = _WHY.get(found.errno, found.strerror or str(found))
    path = found.filename if found.filename is not None else None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    disk = found.errno in (errno.ENOSPC, errno.EDQUOT)
    where = f" writing {path}" if path and disk else (f" at {path}" if path else "")
    if not path and disk and full_disk:
        where = f" holding {full_disk}"
    fix = _FIX.get(found.errno)
    return f"{why}{where} ([Errno {found.errno}] {found.strerror})" + (f": {fix}" if fix else "")

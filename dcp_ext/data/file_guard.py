"""Data files that change under a running job are said in one line, not a crash.

Why it exists: the `.bin/.idx` files are memory-mapped. When another job rewrites or
truncates one mid-run, reading a lost page raises SIGBUS and the process dies with nothing
printed (exit 135), or, worse, reads other documents than it planned from. Every file a
dataset opens is watched (size, modification time, inode, recorded at open); the training
loop calls `check()` once an iteration (a few `stat`s) and a change stops the run with a
DataError naming the file. A change that lands between two checks and is then read is
caught by a C SIGBUS handler (csrc/guard/sigbus_guard.cpp) that prints the same kind of
line and exits 1.
"""
from __future__ import annotations

import os
import time

from dcp_ext.data.errors import DataError

_WATCHED: dict[str, tuple[int, int, int]] = {}  # path -> (size, mtime_ns, inode) when first opened


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def watch(*paths: str) -> None:
    """Record these files as they are now (a file already watched keeps its first record)."""
    for path in paths:
        path = os.path.abspath(path)
        if path in _WATCHED:
            continue
        sig = _signature(path)
        if sig is not None:
            _WATCHED[path] = sig
    _arm_sigbus()


def watched() -> list[str]:
    return sorted(_WATCHED)


def forget() -> None:
    """Stop watching every file (tests; a process that opens other data)."""
    _WATCHED.clear()


def check() -> None:
    """Raise DataError naming the first watched file that is gone or differs from its record."""
    for path, (size, mtime_ns, inode) in _WATCHED.items():
        now = _signature(path)
        if now == (size, mtime_ns, inode):
            continue
        if now is None:
            what = "was deleted"
        elif now[2] != inode:
            what = "was replaced by another file"
        elif now[0] != size:
            what = f"changed size ({size:,} -> {now[0]:,} bytes)"
        else:
            what = f"was rewritten (modified {time.strftime('%H:%M:%S', time.localtime(now[1] / 1e9))})"
        raise DataError(f"{path} {what} while this job was reading it: another job changed the data under it; "
                        "restore the file (or point --data-path at a copy nobody writes), then rerun to resume "
                        "from the last checkpoint")


def _arm_sigbus() -> None:
    """(Re)install the SIGBUS line naming the watched files; without the extension, nothing."""
    try:
        from dcp_ext.data import _sigbus
    except ImportError:
        return
    names = [p for p in sorted(_WATCHED) if p.endswith(".bin")] or sorted(_WATCHED)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    _sigbus.install(f"error: a data file was cut short while this job read it (SIGBUS reading one of: {shown}): "
                    "another job changed the data under it; restore it, then rerun to resume from the last checkpoint")

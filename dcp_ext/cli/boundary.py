"""The one error boundary of every console tool: bad input ends in one line, never a traceback.

Why it exists: dcp-plan, dcp-simulate, dcp-profile, dcp-dataset-stats, preprocess_data.py and
convert_dcp_checkpoint.py each caught a different subset of their failures, so a read-only
folder, a full disk or a Ctrl-C ended in a traceback in one tool and a line in another. Each
tool's main now runs through `run_tool`, which turns

    a bad argument (CLIError, argparse through `Parser`, SystemExit with a message)  -> exit 2
    the tool's own error types (given by the tool, with their exit code)             -> theirs
    an OSError (permission, read-only file system, full disk, missing file)         -> exit 1
    KeyboardInterrupt                                                                -> exit 130

into one `error:` line on stderr. Anything else is a bug and still raises. `check_output`
finds an unwritable output path before the tool's work (a profile takes minutes), and
`writing` names the flag and path of a write that fails halfway (a disk that fills).

Standard library only: the data tools import it too, and nothing here may pull in numpy,
torch or megatron.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from contextlib import contextmanager
from typing import Callable, Mapping

PROBE_BYTES = 64 * 1024  # what check_output writes: a full disk refuses it, a nearly full one may not


class CLIError(Exception):
    """Bad input to a tool: one `error:` line on stderr and exit `code` (2: flags, 1: files)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one CLIError line (no usage block)."""

    def error(self, message):
        raise CLIError(f"{message} (see {self.prog} --help)", 2)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------- OS errors in words
def os_problem(e: OSError, flag: str | None = None) -> tuple[str, str]:
    """(what the OS said, in words; what to do about it) for an OSError. With `flag` (the
    output option that gave the path) the fix is about writing there; without, the error may
    be a read or a write, and the fix says what to check."""
    code = e.errno
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied", (f"fix its permissions or point {flag} to a path this user can write" if flag
                                     else "check its permissions")
    if code == errno.EROFS:
        return "read-only file system", (f"point {flag} to a path on a writable file system" if flag
                                         else "write elsewhere")
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", None)):
        problem = "no space left on the device" if code == errno.ENOSPC else "disk quota exceeded"
        return problem, f"free space there or point {flag} to another disk" if flag else "free space on that disk"
    if code == errno.ENOENT:
        return "no such file or directory", "check the path"
    if code == errno.EISDIR:
        return "is a directory", "give a file name"
    if code == errno.ENOTDIR:
        return "a part of the path is a file, not a folder", "check the path"
    return (e.strerror or first_line(e)).lower(), "check the path"


def os_error_line(e: OSError, flag: str | None = None, path: str | None = None, what: str | None = None) -> str:
    """One line for an OSError: the flag and path it is about, what failed (the file the OS
    named, else `what`), and the fix."""
    problem, fix = os_problem(e, flag)
    failed = e.filename if e.filename is not None else path
    if flag:
        where = f"{flag} {path}" if path else flag
        detail = failed if failed and failed != path else what
        return f"{where}: {problem}{f' (writing {detail})' if detail else ''}; {fix}"
    return f"{failed}: {problem}; {fix}" if failed else f"{problem}; {fix}"


@contextmanager
def writing(flag: str, path: str, what: str | None = None):
    """Run a block that writes the output `path` of `flag` (`what`: the thing written, for the
    message); an OSError becomes a CLIError that names them (the OS's own error often names no
    file, e.g. a full disk)."""
    try:
        yield
    except OSError as e:
        raise CLIError(os_error_line(e, flag, path, what), 1) from None


# ---------------------------------------------------------------- outputs, checked first
def existing_ancestor(path: str) -> str:
    """The path itself if it exists, else its nearest existing parent."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def write_probe(folder: str) -> OSError | None:
    """Create, write (PROBE_BYTES), fsync and remove a probe file in `folder`; the OS error, if
    any. The name holds host and pid: ranks of one job may probe one shared folder at once."""
    name = os.path.join(folder, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    except OSError as e:
        return e
    finally:
        os.close(fd)
        try:
            os.remove(name)
        except OSError:
            pass
    return None


def check_output(flag: str, path: str, *, make_folder: bool = False) -> None:
    """Raise CLIError (exit 1) unless the tool can write the file `path` given by `flag`: not a
    directory, in a folder that exists (or that the tool makes, `make_folder`) and takes a
    64 KiB file. Nothing is left behind."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise CLIError(f"{flag} {path}: is a directory, not a file; give {flag} a file name", 1)
    folder = os.path.dirname(full)
    base = existing_ancestor(folder)
    if not os.path.isdir(base):
        raise CLIError(f"{flag} {path}: {base} is a file, not a folder; point {flag} to a file in a folder", 1)
    if base != folder and not make_folder:
        raise CLIError(f"{flag} {path}: folder {folder} does not exist: create it (mkdir -p {folder}) "
                       f"or point {flag} elsewhere", 1)
    err = write_probe(base)
    if err is None and os.path.isfile(full):
        try:  # an existing file is replaced: it must be writable too (opened, never truncated here)
            os.close(os.open(full, os.O_WRONLY | os.O_APPEND))
        except OSError as e:
            err = e
    if err is not None:
        problem, fix = os_problem(err, flag)
        raise CLIError(f"{flag} {path}: {problem} (cannot create files in {base}); {fix}", 1)


# ---------------------------------------------------------------- the boundary
def run_tool(body: Callable[[], int], *, prog: str = "", errors: Mapping[type, int] | None = None,
             interrupted: str = "interrupted (Ctrl-C)", quiet: bool = False) -> int:
    """Call a tool's body and return its exit code; its known failures become one line.

    `errors`: the tool's own exception types and their exit codes (first match wins).
    `prog`: said before `error:` (tools whose lines always began with their name).
    `interrupted`: the Ctrl-C line (a tool that cleaned up says so). `quiet`: print nothing
    (ranks other than 0 of a launched tool); the exit code is the same."""

    def say(message: str, code: int) -> int:
        if not quiet:
            print(f"{prog}{': ' if prog else ''}error: {message}", file=sys.stderr, flush=True)
        return code

    try:
        return body()
    except CLIError as e:
        return say(first_line(e), e.code)
    except KeyboardInterrupt:
        return say(interrupted, 130)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            raise  # a plain exit (--help): not an error
        message = str(e.code).strip()
        return say(message[len("error:"):].strip() if message.startswith("error:") else message, 2)
    except Exception as e:
        for kind, code in (errors or {}).items():
            if isinstance(e, kind):
                return say(first_line(e), code)
        if isinstance(e, OSError):
            return say(os_error_line(e), 1)
        raise

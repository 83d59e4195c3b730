"""One training job per `--save` directory at a time: the lock file `{save}/checkpoint.lock`.

Why it exists: two jobs started on the same `--save` (a relaunch while the first still runs,
two sweeps sharing an output path) both write `iter_N/` and the tracker. The save protocol
(`checkpoint_protocol`) keeps each save whole, not each job's checkpoints: one job's save
replaces the other's, or dies in the other's staging folder. So rank 0 takes this lock
before training starts (right after the output-path preflight) and gives it back at exit:
a normal end, an error, SIGTERM, Ctrl-C. A second job refuses before it starts, in one line
naming the holder; every rank learns rank 0's verdict.

The lock is a small JSON file created atomically (O_CREAT|O_EXCL, honoured by shared file
systems) that names its holder: host, pid, the process's start (a pid reused by another
process has another start), when it was taken, the command, and the directory it was taken
for. A holder that died without giving it back (SIGKILL, a lost node) leaves it behind: on
the holder's host the next job sees that the pid is gone or reused, says so in one line and
takes it over. A lock taken on another host cannot be checked from here: the job refuses and
names the file to remove if the user is sure, unless the lock was left by an earlier attempt of
the same torchrun job (`--max-restarts` after a node was lost): torchrun starts an attempt only
once the previous one has stopped everywhere. A copy of the directory made while its job ran
carries the lock along; it names the directory it was taken for, so it does not hold the copy.

The checkpoint code never reads it: `recover()` and the loader only touch `iter_*` names
and the tracker.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass

from megatron.training.startup import stop_signals
from megatron.training.checkpoint.protocol import CheckpointError

LOCK_NAME = "checkpoint.lock"
SETTLE_S = 1.0  # how long a lock file being written by its taker may stay unreadable
ATTEMPTS = 5  # rounds of create / judge / take over before giving up


class CheckpointLockError(CheckpointError):
    """`--save` belongs to another job (or its lock cannot be judged); the message says what to do."""


@dataclass
class _Held:
    path: str
    token: str
    pid: int
    save: str
    made_dir: bool
    on_sigterm: bool = False


_held: _Held | None = None


def lock_path(save: str) -> str:
    return os.path.join(save, LOCK_NAME)


# ------------------------------------------------------------------ processes
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:8]
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """A string that tells this process apart from any other that had or will have its pid
    (boot and start tick on Linux, psutil's create time elsewhere; "" where neither can be
    read), or None when no such process runs (a zombie is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else f"{_boot_id()}:{fields[19]}"
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # Linux: no such process
    except (OSError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return "" if _pid_exists(pid) else None
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else f"{p.create_time():.2f}"
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return "" if _pid_exists(pid) else None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ the record
def our_record(save: str) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": process_start(pid) or "", "since": time.time(),
            "command": " ".join(sys.argv)[:1000], "dir": os.path.realpath(save), "token": uuid.uuid4().hex,
            **_attempt()}


def _attempt() -> dict:
    """Which torchrun job and attempt this is (`--max-restarts` starts attempt k+1 only once every
    worker of attempt k has stopped, on every node): {} outside torchrun."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    try:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
    except ValueError:
        return {}
    return {"run": run, "attempt": attempt} if run else {}


def _when(record: dict) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["since"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        return "an unknown time"


def _short_command(record: dict) -> str:
    cmd = " ".join(str(record.get("command", "")).split())
    return cmd if len(cmd) <= 120 else cmd[:117] + "..."


def judge(record: dict, save: str, host: str | None = None, start_of=process_start) -> tuple[str, str]:
    """(verdict, why) for the lock `record` found in `save`: 'live' (its holder runs),
    'foreign' (held from another host: cannot be checked) or 'stale' (why: what shows it)."""
    host = host or socket.gethostname()
    ours = _attempt()
    if ours and record.get("run") == ours["run"] and isinstance(record.get("attempt"), int) \
            and record["attempt"] < ours["attempt"]:
        return "stale", f"left by attempt {record['attempt']} of this torchrun job, which has stopped"
    if record.get("host") != host:
        return "foreign", ""
    taken_for = record.get("dir")
    if taken_for and taken_for != os.path.realpath(save) and not _same_dir(taken_for, save):
        return "stale", f"it was taken for {taken_for}; this is a copy"
    pid = int(record["pid"])
    start = start_of(pid)
    if start is None:
        return "stale", "it is no longer running"
    if record.get("start") and start and start != record["start"]:
        return "stale", "its pid now belongs to another process"
    if pid == os.getpid():
        return "stale", "left by this very process"
    return "live", ""


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _read(path: str):
    """The record in `path`: a dict, None if there is no such file, or a string saying why it
    cannot be read (empty while its taker writes it, or damaged)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return (e.strerror or str(e)).lower()
    try:
        record = json.loads(text)
        if isinstance(record, dict) and isinstance(record.get("pid"), int) and record.get("host"):
            return record
    except ValueError:
        pass
    return "empty" if not text.strip() else "not a lock record"


def _read_settled(path: str):
    """`_read`, waiting up to SETTLE_S for a lock that another job has created but not yet written."""
    deadline = time.time() + SETTLE_S
    while True:
        got = _read(path)
        if not isinstance(got, str) or time.time() >= deadline:
            return got
        time.sleep(0.05)


# ------------------------------------------------------------------ rank 0's steps
def _create(path: str, record: dict) -> None:
    """Create the lock with `record` in it; FileExistsError if there is one already."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.remove(path)
        raise
    os.close(fd)


def _remove_if_still(path: str, record: dict) -> bool:
    """Remove the stale lock `record`, unless another job has replaced it meanwhile: the file is
    renamed aside first (atomic), and put back if it is not the one judged."""
    aside = f"{path}.{socket.gethostname()}.{os.getpid()}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    moved = _read(aside)
    if isinstance(moved, dict) and moved.get("token") == record.get("token"):
        os.remove(aside)
        return True
    try:
        os.link(aside, path)  # fails if yet another job has taken it since: then that one holds it
    except OSError:
        pass
    os.remove(aside)
    return False


def _refusal(save: str, path: str, record, verdict: str) -> str:
    if isinstance(record, str):
        return (f"--save {save}: its lock file {path} cannot be read ({record}); if no other job uses {save}, "
                f"remove {path} and rerun")
    who = f"pid {record['pid']} on host {record['host']}, since {_when(record)}"
    if verdict == "foreign":
        return (f"--save {save}: locked by a job on another host ({who}) that this host "
                f"({socket.gethostname()}) cannot check; wait for it to end, or, if you are sure no job uses "
                f"{save}, remove {path} and rerun")
    cmd = _short_command(record)
    return (f"--save {save}: in use by another training job ({who}{': ' + cmd if cmd else ''}); wait for it "
            "to end or point --save to another directory")


def take(save: str) -> str | None:
    """Rank 0: make `save` this process's, or raise CheckpointLockError naming the holder.
    Returns the line to print when a stale lock was taken over."""
    global _held
    path = lock_path(save)
    if _held is not None and _held.path == path and _held.pid == os.getpid():
        return None
    made_dir = not os.path.isdir(save)
    os.makedirs(save, exist_ok=True)
    note = None
    for _ in range(ATTEMPTS):
        record = our_record(save)
        try:
            _create(path, record)
        except FileExistsError:
            pass
        else:
            _held = _Held(path, record["token"], record["pid"], save, made_dir)
            return note
        found = _read_settled(path)
        if found is None:
            continue  # its holder just gave it back
        if isinstance(found, str):
            raise CheckpointLockError(_refusal(save, path, found, ""))
        verdict, why = judge(found, save)
        if verdict != "stale":
            raise CheckpointLockError(_refusal(save, path, found, verdict))
        if _remove_if_still(path, found):
            note = (f"note: taking over the stale lock of pid {found['pid']} on {found['host']} (taken "
                    f"{_when(found)}; {why}) in {save}")
    raise CheckpointLockError(f"--save {save}: other jobs keep taking its lock {path}; run one job per --save "
                              "directory")


def release() -> None:
    """Give the lock back if this process holds one (a no-op otherwise; safe to call twice, and
    in a forked child, which never owns its parent's lock). A lock that is no longer ours
    (removed by hand and taken by another job) is left alone."""
    global _held
    held = _held
    if held is None or held.pid != os.getpid():
        return
    _held = None
    _restore_sigterm(held)
    found = _read(held.path)
    if isinstance(found, dict) and found.get("token") == held.token:
        try:
            os.remove(held.path)
        except OSError:
            pass
    if held.made_dir:
        try:
            os.rmdir(held.save)  # only if the run left it empty (it failed before its first save)
        except OSError:
            pass


stop_signals.at_sigterm(release)  # a SIGTERM gives the lock back before the rank dies


# ------------------------------------------------------------------ SIGTERM
def _release_on_sigterm(held: _Held) -> None:
    """SIGTERM's default kills without running any Python: hook it on rank 0 where nothing
    has yet (a caller of `acquire` other than `pretrain`, which hooks every rank at start)."""
    held.on_sigterm = stop_signals.say_why_on_sigterm()


def _restore_sigterm(held: _Held) -> None:
    if held.on_sigterm:
        stop_signals.uninstall()


# ------------------------------------------------------------------ the job
def acquire(save: str | None) -> None:
    """Collective when torch.distributed is up: rank 0 takes the lock of `--save` (if given),
    every rank learns the verdict; raises CheckpointLockError (the same line on every rank)
    when another job holds it."""
    if not save:
        return
    import torch.distributed as dist

    from megatron.training.initialize import print_rank_0
    from megatron.training.startup.preflight import os_problem_line

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problem = note = None
    if rank == 0:
        try:
            note = take(save)
        except CheckpointLockError as e:
            problem = str(e)
        except OSError as e:
            what, fix = os_problem_line(e, "--save", "directory")
            problem = f"--save {save}: {what} (cannot create its lock file {lock_path(save)}): {fix}"
        if problem is None and _held is not None:
            _release_on_sigterm(_held)
    if distributed and world > 1:
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if note:
        print_rank_0(note)
    if problem:
        raise CheckpointLockError(problem)

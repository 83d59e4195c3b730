"""A collective that failed because of another rank, said in one line: which rank, which collective.

Why it exists: a stalled or dead peer surfaces on every surviving rank as a raw RuntimeError
from gloo (`Timed out waiting 60000ms for recv operation to complete`, `Connection closed by
peer`) or NCCL, deep inside megatron-core or the runtime. `fault_line` turns it into the one
line `pretrain` prints: the rank that stopped answering (from the heartbeats,
megatron/training/startup/liveness.py; "cannot be told" when the store is silent too), the
collective and where it was called (read from the traceback: the torch.distributed function,
its group's ranks, the first frame outside torch), how it failed (timed out after N s, with
the flag that sets N, or the connection closed), and what to do.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from typing import Optional

from megatron.training.startup import liveness
from megatron.training.startup.os_errors import exception_chain

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_CLOSED = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
           "NCCL communicator was aborted", "Socket Timeout")
_GLOO_MS = re.compile(r"[Tt]imed out waiting (\d+)\s*ms")
_NCCL_MS = re.compile(r"Timeout\(ms\)=(\d+)")
_NCCL_OP = re.compile(r"OpType=(\w+)")


def is_collective_failure(e: BaseException) -> bool:
    """A collective failed because of a peer (it died, hangs or stopped), not a bug of this rank."""
    text = str(e)
    return isinstance(e, RuntimeError) and (any(k in text for k in _CLOSED) or bool(_TIMEOUT.search(text)))


def find_collective_failure(e: BaseException) -> Optional[BaseException]:
    """`e` or the collective failure inside it (torch's CheckpointException wraps each rank's)."""
    for x in exception_chain(e):
        if is_collective_failure(x):
            return x
    return None


def timed_out_after_s(text: str) -> Optional[float]:
    """The timeout the message reports, in seconds (gloo: `waiting 60000ms`, NCCL: `Timeout(ms)=`)."""
    m = _GLOO_MS.search(text) or _NCCL_MS.search(text)
    return int(m.group(1)) / 1000.0 if m else None


def _short_path(filename: str) -> str:
    """A frame's file as a reader finds it: from the package root (megatron/, dcp_ext/, torch/)."""
    path = filename.replace(os.sep, "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for root in ("megatron/", "dcp_ext/", "tools/", "tests/", "pretrain_gpt_dcp.py"):
        i = path.rfind("/" + root)
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


def _is_torch_distributed(filename: str) -> bool:
    return "/torch/distributed/" in filename.replace(os.sep, "/")


_STDLIB = os.path.dirname(contextlib.__file__)


def _is_plumbing(filename: str) -> bool:
    """torch.distributed itself, or the standard library between it and its caller (contextlib's
    `with` of a coalescing manager)."""
    return _is_torch_distributed(filename) or (filename.startswith(_STDLIB) and "-packages" not in filename)


def _op_name(function: str) -> str:
    """A torch.distributed function as a reader knows it (`_coalescing_manager`: the block of
    collectives megatron-core's DDP issues together)."""
    if function == "_coalescing_manager":
        return "coalesced collectives"
    return function.lstrip("_")


def collective_of(tb) -> str:
    """`all_gather over ranks 0-2 at dcp_ext/runtime/engine.py:183 (_reduce)` from a traceback:
    the innermost frame outside torch.distributed (and the standard library between), the
    torch.distributed function it called (a `work.wait()` on an asynchronous one has none: 'a
    wait on an asynchronous collective'), and that function's group's ranks."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    op, group_ranks = None, None
    last_own = max((i for i, f in enumerate(frames) if not _is_plumbing(f.f_code.co_filename)), default=-1)
    caller = frames[last_own] if last_own >= 0 else None
    for frame in frames[last_own + 1:]:  # the function of torch.distributed the caller entered
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py"):
            op = _op_name(code.co_name)
            group_ranks = _group_ranks(frame.f_locals.get("group"))
            break
    return describe_site(op, group_ranks, None if caller is None else
                         (_short_path(caller.f_code.co_filename), caller.f_lineno, caller.f_code.co_name))


def describe_site(op: Optional[str], group_ranks: Optional[list], caller: Optional[tuple]) -> str:
    what = op if op else "a wait on an asynchronous collective"
    if op and group_ranks:
        what += f" over ranks {rank_list(group_ranks)}"
    if caller:
        path, line, name = caller
        what += f" at {path}:{line} ({name})"
    return what


def _group_ranks(group) -> Optional[list]:
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except Exception:
        return None


def rank_list(ranks) -> str:
    """`0-3, 6, 9-10`: ranks in runs."""
    ranks = sorted(set(int(r) for r in ranks))
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(runs)


def _peers_phrase(peers) -> str:
    """`rank 1 (pid 4829 on node-a)`, or for several `ranks 2-3 (on node-b)`."""
    if len(peers) == 1:
        return peers[0].phrase()
    hosts = sorted({p.host for p in peers})
    where = f" (on {', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts != ["?"] else ""
    return f"ranks {rank_list(p.rank for p in peers)}{where}"


_STATE = {"stopped": "it is stopped (SIGSTOP, a debugger or a job control stop)", "gone": "it is gone (it died or was killed)",
          "stuck in the kernel": "it is stuck in the kernel (state D: a hung disk, network filesystem or driver)",
          "running": "it runs but its heartbeat stopped (a long call that holds Python's lock)"}


def fault_line(e: BaseException, timeout_minutes: int, diagnosis: Optional[liveness.Diagnosis] = None) -> str:
    """The one line for a collective that failed because of a peer (see the module's note).
    `diagnosis`: who stopped answering (default: ask this rank's heartbeat now)."""
    text = str(e).strip()
    first = text.splitlines()[0][:200] if text else type(e).__name__
    site = collective_of(e.__traceback__)
    if _NCCL_OP.search(text) and site.startswith("a wait"):
        site = f"{_NCCL_OP.search(text).group(1).lower()} (NCCL)" + site[len("a wait on an asynchronous collective"):]
    seconds = timed_out_after_s(text)
    timed_out = seconds is not None or (bool(_TIMEOUT.search(text)) and not any(k in text for k in _CLOSED))
    if timed_out:
        after = f"after {seconds:g} s " if seconds is not None else ""
        how = f"{site} timed out {after}(--distributed-timeout-minutes {timeout_minutes})"
    else:
        how = f"{site} failed ({first})"
    if diagnosis is None:
        beat = liveness.active()
        diagnosis = beat.diagnose() if beat is not None else None
    resume = "then rerun to resume from the last checkpoint"
    if diagnosis is None:  # no heartbeat on this run (a world without a store to reach)
        who = "which rank stopped answering is not known (no heartbeats on this launch)"
        return f"lost contact with another rank: {how}; {who}; see every rank's log, {resume}"
    if not diagnosis.reachable:
        return (f"lost contact with another rank: {how}; which rank stopped answering cannot be told: the job's store "
                f"at {diagnosis.store} does not answer either (outside torchrun rank 0 holds it: it may be the one); "
                f"see every rank's log, {resume}")
    if diagnosis.stopped:
        peers = diagnosis.stopped
        state = ""
        if len(peers) == 1 and peers[0].state in _STATE:
            state = f": {_STATE[peers[0].state]}"
        verb = "stopped answering" if timed_out else "lost contact"
        head = (f"{_peers_phrase(peers)} stopped answering{state}" if verb == "stopped answering"
                else f"lost contact with {_peers_phrase(peers)}{state or ': it stopped answering'}")
        whose = "its log and machine" if len(peers) == 1 else "their logs and machines"
        return f"{head}; {how}; see {whose}, {resume}"
    if diagnosis.departed:
        peer, reason = diagnosis.departed[0]
        more = f" (and {len(diagnosis.departed) - 1} more)" if len(diagnosis.departed) > 1 else ""
        return f"lost contact with {peer.phrase()}{more}, which stopped: {reason[:240]}; {how}; {resume}"
    if timed_out:
        return (f"{how}, yet every rank still answers: one of them waits in another collective (ranks that disagree "
                f"on what to run next: a deadlock); see every rank's log (py-spy dump shows where each waits), {resume}")
    return f"lost contact with another rank ({first}): it died or hangs; see its log, {resume}"


@contextlib.contextmanager
def sigterm_deferred():
    """While the line is worked out (the heartbeats take a few seconds), a SIGTERM from torchrun
    (stopping the ranks after the first one failed) waits: the line then says why, not
    'stopped by SIGTERM'. The process exits right after either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

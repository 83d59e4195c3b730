"""Every rank's heartbeat in the job's store: who stopped answering, and a launcher that went away.

Why it exists: when a collective fails, gloo says only `Timed out waiting 60000ms for recv
operation to complete` (or `Connection closed by peer`): not which rank. A rank that was
stopped (SIGSTOP, a debugger, a frozen node) cannot say anything either. So from start-up
on, a daemon thread of every rank adds 1 to its counter `beat/RANK` in the job's key-value
store (torchrun's agent store, or rank 0's under a plain launch) every `interval` seconds,
and once writes `who/RANK` = host and pid. When a collective fails, `diagnose` names:

- ranks on this host whose process is stopped (state T) or gone, at once (/proc);
- otherwise the ranks whose counter did not move during a few intervals (no clock is
  compared across machines);
- ranks that left on purpose (`left/RANK`: their own error line, or "finished") are not
  stalled: their reason is quoted instead.

The thread also watches its launcher: a torchrun worker whose parent changed (the agent was
killed, its workers live on) would train unsupervised and leave the other nodes' agents
waiting; it says so in one line and stops its rank (`_launcher_gone`).

Cost: one store round trip per rank per interval (1 s, longer above 1000 ranks); nothing
while training is healthy but that. Failures of the store itself are never raised from the
thread: it stops beating quietly (peers then say the store does not answer, or name it).
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

STORE_TIMEOUT_S = 5.0  # a store that does not answer within this is "not answering"
LAUNCHER_GRACE_S = 20.0  # after asking the main thread to stop, how long before the process is ended
BEATS_PER_WINDOW = 3  # a counter that did not move over this many intervals is a stalled rank


def interval_for(world_size: int) -> float:
    """Seconds between two beats: 1 s, so a stall is told within ~3 s; longer above 1000
    ranks, so the store sees at most ~1000 beats a second."""
    return max(1.0, world_size / 1000.0)


@dataclass
class Peer:
    rank: int
    host: str = "?"
    pid: int = 0
    state: Optional[str] = None  # on this host: 'stopped', 'gone', 'stuck in the kernel', 'running'

    def phrase(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})" if self.pid else f"rank {self.rank}"


@dataclass
class Diagnosis:
    reachable: bool = True  # the store answered
    stopped: list = field(default_factory=list)  # Peers that stopped answering (no beat, no reason left)
    departed: list = field(default_factory=list)  # (Peer, reason): ranks that left on purpose, saying why
    store: str = "?"  # host:port of the store, for the line


def process_state(pid: int) -> Optional[str]:
    """The state of a process on this host, in words: 'stopped' (T/t: SIGSTOP, a debugger),
    'gone' (no such process, or a zombie), 'stuck in the kernel' (D), 'running' otherwise;
    None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    state = text.rsplit(")", 1)[-1].split()[0] if ")" in text else "?"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone", "D": "stuck in the kernel"}.get(state, "running")


def read_counters(store, world_size: int) -> dict[int, int]:
    """Every rank's beat counter (`add(key, 0)` reads without blocking on a missing key)."""
    return {r: int(store.add(f"beat/{r}", 0)) for r in range(world_size)}


def left_reason(store, rank: int) -> Optional[str]:
    key = f"left/{rank}"
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def who(store, rank: int) -> Peer:
    key = f"who/{rank}"
    if not store.check([key]):
        return Peer(rank)
    host, _, pid = store.get(key).decode(errors="replace").rpartition(" ")
    return Peer(rank, host or "?", int(pid) if pid.isdigit() else 0)


def diagnose_store(store, rank: int, world_size: int, host: str, interval: float, wait: bool = True,
                   sleep=time.sleep) -> Diagnosis:
    """Who stopped answering, read from `store` (any torch.distributed Store); see the module's note."""
    d = Diagnosis()
    peers = {r: who(store, r) for r in range(world_size) if r != rank}
    reasons = {r: left_reason(store, r) for r in peers}
    for r, peer in peers.items():  # this host's ranks: their process state, at once
        if peer.host == host and peer.pid:
            peer.state = process_state(peer.pid)
    for r, peer in peers.items():
        if reasons[r] is not None and reasons[r] != "finished":
            d.departed.append((peer, reasons[r]))
        elif reasons[r] is None and peer.state in ("stopped", "gone", "stuck in the kernel"):
            d.stopped.append(peer)
    if d.stopped or d.departed or not wait:  # a rank that left saying why explains the loss of contact
        return d
    before = read_counters(store, world_size)
    sleep(BEATS_PER_WINDOW * interval)
    after = read_counters(store, world_size)
    known = {p.rank for p, _ in d.departed}
    for r, peer in peers.items():
        if after[r] != before[r] or r in known:
            continue
        reason = left_reason(store, r)  # it may have left during the window
        if reason is None:
            d.stopped.append(peer)
        elif reason != "finished":
            d.departed.append((peer, reason))
    return d


class Heartbeat:
    """The thread of one rank: beats, and watches its launcher (a torchrun worker's parent)."""

    def __init__(self, store, rank: int, world_size: int, interval: float, store_address: str,
                 launcher_pid: Optional[int] = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval, self.store_address, self.launcher_pid = interval, store_address, launcher_pid
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.stop_line: Optional[str] = None  # set when the thread stopped the rank (launcher gone)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcp-heartbeat", daemon=True)

    def start(self) -> None:
        self.store.set(f"who/{self.rank}", f"{self.host} {self.pid}")
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                self._launcher_gone()
                return
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # the store is gone (its host exited) or stuck: stop beating, quietly
                return

    def leave(self, reason: str) -> None:
        """Say in the store why this rank stops (peers quote it instead of calling it stalled)."""
        try:
            self.store.set(f"left/{self.rank}", reason[:400])
        except Exception:
            pass

    def stop(self, reason: str = "finished") -> None:
        self.leave(reason)
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=STORE_TIMEOUT_S)

    def diagnose(self, wait: bool = True) -> Diagnosis:
        try:
            d = diagnose_store(self.store, self.rank, self.world_size, self.host, self.interval, wait=wait)
        except Exception:  # the store does not answer (stopped, or its host is the rank that stopped)
            d = Diagnosis(reachable=False)
        d.store = self.store_address
        return d

    def _launcher_gone(self) -> None:
        """This torchrun worker's launcher died (its parent changed): one line, then stop the rank.
        The main thread gets KeyboardInterrupt (pretrain exits 1 without a second line); a main
        thread that cannot take it (blocked in a collective whose peers are gone) is ended
        after LAUNCHER_GRACE_S."""
        import _thread

        from megatron.training.checkpoint import lock as checkpoint_lock
        from megatron.training.startup import stop_signals

        self.stop_line = (f"the launcher of this node (torchrun, pid {self.launcher_pid}) is gone: rank {self.rank} "
                          "stops (nothing would restart, stop or report it); see why the launcher died (killed, "
                          "out of memory), then rerun the job to resume from the last checkpoint")
        self.leave(f"its node's launcher (torchrun, pid {self.launcher_pid} on {self.host}) is gone")
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        try:
            print(f"{prefix}error: {self.stop_line}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        stop_signals.reason_given()
        _thread.interrupt_main()
        time.sleep(LAUNCHER_GRACE_S)
        checkpoint_lock.release()
        os._exit(1)


_active: Optional[Heartbeat] = None


def start(rank: int, world_size: int) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (a world of one has no peers: nothing). The store is a client
    of the job's own (MASTER_ADDR:MASTER_PORT), namespaced by torchrun's restart count."""
    global _active
    if world_size <= 1 or _active is not None:
        return _active
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
    timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    try:
        client = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception:  # no store to reach (a launcher of its own kind): no heartbeat, the lines say less
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"dcp/liveness/attempt_{attempt}", client)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    beat = Heartbeat(store, rank, world_size, interval_for(world_size), f"{addr}:{port}",
                     launcher_pid=os.getppid() if under_torchrun else None)
    try:
        beat.start()
    except Exception:
        return None
    _active = beat
    return beat


def active() -> Optional[Heartbeat]:
    return _active


def stop(reason: str = "finished") -> None:
    """This rank ends on purpose (`reason`: 'finished', or its error line): peers will not call it stalled."""
    global _active
    if _active is not None:
        _active.stop(reason)
        _active = None


def leave(reason: str) -> None:
    if _active is not None:
        _active.leave(reason)


def launcher_stop_line() -> Optional[str]:
    """The line the heartbeat printed when it stopped this rank because its launcher is gone."""
    return _active.stop_line if _active is not None else None

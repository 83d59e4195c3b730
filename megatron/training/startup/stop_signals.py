"""SIGTERM on a training rank: one line saying why it stops, the cleanups it owes, then death.

Why it exists: torchrun stops the surviving ranks with SIGTERM when one fails, and a cluster
cancels a job the same way. Python's default for SIGTERM kills without running any Python,
so a rank would vanish without a word and leave behind what it holds (the `--save` lock).
Every rank installs `say_why_on_sigterm` at start; owners of something to give back register
it with `at_sigterm` (the lock registers its `release`). A rank that already printed why it
stops calls `reason_given`, so torchrun's SIGTERM that follows adds no second line.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

SIGTERM_LINE = ("error: stopped by SIGTERM: torchrun stops every rank when one fails (its report follows), or the "
                "job was cancelled; rerun to resume from the last checkpoint")

_reason_given = False
_cleanups: list = []


def reason_given() -> None:
    """This rank has printed why it stops: a SIGTERM that arrives while it exits (torchrun
    stopping the survivors) adds no second line."""
    global _reason_given
    _reason_given = True


def was_reason_given() -> bool:
    return _reason_given


def at_sigterm(cleanup) -> None:
    """Run `cleanup()` (no arguments, safe to call twice) before a SIGTERM kills this rank."""
    if cleanup not in _cleanups:
        _cleanups.append(cleanup)


def on_sigterm(signum, frame) -> None:
    """Say why in one line (a rank waiting on its own work, e.g. its next plan, is stopped
    by torchrun before a collective could tell it a peer died) unless it already said why,
    run the registered cleanups, then die of the signal as if no handler were installed."""
    if not _reason_given:
        try:
            sys.stderr.write(SIGTERM_LINE + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    for cleanup in list(_cleanups):
        cleanup()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def say_why_on_sigterm() -> bool:
    """Install `on_sigterm`, only on the main thread and where nothing else handles SIGTERM
    (`--exit-signal-handler` installs its own during training and restores this one after).
    True when it installed it."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.siginterrupt(signal.SIGTERM, False)  # a blocking collective resumes instead of failing with EINTR
    return True


def uninstall() -> None:
    """Back to the default where `on_sigterm` is still the handler (main thread only)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

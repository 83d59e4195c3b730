"""Lines a test wants in the run's output even when it passes (measured figures the issue asks
CI to print: host syncs per step, bytes per rank). `tests/conftest.py` prints them, by
section, at the end of the session."""
from __future__ import annotations

NOTES: dict[str, list[str]] = {}


def note(section: str, line: str) -> None:
    NOTES.setdefault(section, []).append(line)

"""A small progress bar on stderr for long data jobs (preprocessing, demo corpus, stats).

No dependency (tqdm is not a requirement). On a terminal it redraws one line; elsewhere
(logs, CI) it prints a line at most every `interval_s` seconds so logs stay short.
"""
from __future__ import annotations

import sys
import time


def _human(n: float) -> str:
    if 0 < abs(n) < 10 and n != int(n):
        return f"{n:.1f}" if abs(n) >= 0.1 else f"{n:.2f}"  # a rate below 1/s is not "0"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000.0
    return f"{n:.1f}P"


class Progress:
    """`with Progress("tokenize", total=bytes, unit="B") as p: p.update(k)`."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it",
                 stream=None, interval_s: float | None = None, enabled: bool = True):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.1 if self.tty else 5.0)
        self.enabled = enabled
        self.n = 0
        self.extra = ""
        self._t0 = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self.enabled:  # failed: end the line, no final figures
            if self.tty:
                self.stream.write("\n")
            self.enabled = False
        self.close()

    def update(self, k: int = 1, extra: str | None = None) -> None:
        self.n += k
        if extra is not None:
            self.extra = extra
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._draw(final=False)

    def line(self) -> str:
        dt = max(time.monotonic() - self._t0, 1e-9)
        rate = self.n / dt
        if self.total:
            frac = min(self.n / self.total, 1.0)
            width = 24
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            eta = (self.total - self.n) / rate if rate > 0 else 0.0
            s = (f"{self.desc}: [{bar}] {frac * 100:5.1f}% {_human(self.n)}/{_human(self.total)}"
                 f"{self.unit} {_human(rate)}{self.unit}/s eta {eta:.0f}s")
        else:
            s = f"{self.desc}: {_human(self.n)}{self.unit} {_human(rate)}{self.unit}/s {dt:.1f}s"
        return s + (f" {self.extra}" if self.extra else "")

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(final=True)
            self.enabled = False

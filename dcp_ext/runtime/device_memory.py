"""Peak memory of this rank's device since a starting point, as the run reports it.

Why it exists: `--dcp-device-memory` is a promise (every replica's peak stays within the
budget) and a promise needs a measurement next to it. On a GPU the measurement is the
caching allocator's own peak (`torch.cuda.max_memory_allocated`). A CPU rank has no
device and torch keeps no CPU allocator statistics: its "device memory" is the anonymous
resident memory the process gains after the start point (tensors, autograd's saved
activations, allocator slack; not the code pages of torch's libraries that the first
backward faults in, which are file-backed and on a GPU machine host memory). Linux gives
the current anonymous size (RssAnon) but no peak of it, so a daemon thread samples it
every `interval_s` (torch kernels release the GIL; activations live for whole layers, far
longer than a sample). Where RssAnon is missing, the peak resident size (VmHWM, reset at
the start where /proc/self/clear_refs allows) is the fallback: an upper bound.
"""
from __future__ import annotations

import resource
import threading

import torch

def _status_kib(field: str, pid: int | str = "self") -> int | None:
    """A /proc/<pid>/status field in KiB (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_resident_peak() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM to the current resident size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak device bytes of this process from construction on."""

    def __init__(self, device: torch.device, interval_s: float = 0.002):
        self.device = torch.device(device)
        self.baseline = 0
        self._earlier = 0  # cuda: the peak before the last window_peak_bytes()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        anon = _status_kib("RssAnon")
        self.sampled = anon is not None
        if self.sampled:
            self.baseline = anon * 1024
            self._peak = self._window = self.baseline
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True,
                                            name="peak-memory-sampler")
            self._thread.start()
            return
        _reset_resident_peak()
        rss = _status_kib("VmRSS")
        self.baseline = (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._read()

    def _read(self) -> None:
        anon = _status_kib("RssAnon")
        if anon is not None:
            self._peak = max(self._peak, anon * 1024)
            self._window = max(self._window, anon * 1024)

    def window_peak_bytes(self) -> int | None:
        """The peak since the last call (above the start point), then a new window begins;
        None where only the whole run's peak can be read (the VmHWM fallback)."""
        if self.device.type == "cuda":
            window = int(torch.cuda.max_memory_allocated(self.device))
            self._earlier = max(self._earlier, window)
            torch.cuda.reset_peak_memory_stats(self.device)
            return window
        if not self.sampled:
            return None
        self._read()
        window, self._window = self._window, _status_kib("RssAnon") * 1024
        return max(0, window - self.baseline)

    def current_bytes(self) -> int | None:
        """Bytes held now above the start point (GPU: allocated tensors); None where only
        peaks can be read (the VmHWM fallback)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        if not self.sampled:
            return None
        return max(0, _status_kib("RssAnon") * 1024 - self.baseline)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return max(self._earlier, int(torch.cuda.max_memory_allocated(self.device)))
        if self.sampled:
            self._read()
            return max(0, self._peak - self.baseline)
        hwm = _status_kib("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, hwm * 1024 - self.baseline)

    @property
    def what(self) -> str:
        if self.device.type == "cuda":
            return "allocator peak"
        if self.sampled:
            return f"anonymous resident peak above the {self.baseline / 2**20:.0f} MiB at start"
        return f"resident peak above the {self.baseline / 2**20:.0f} MiB at start"


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def return_freed_memory(mmap_threshold: int = 64 * 1024, trim_threshold: int = 1 << 20) -> bool:
    """CPU ranks under a memory budget: make the memory the process holds be what its live
    tensors need. torch's CPU tensors come from glibc malloc, which by default raises its
    mmap threshold after each large free and keeps freed blocks in its heap for reuse: the
    demo (256 MB budget, planned peak ~225 MiB) then held 420-510 MiB per rank; with blocks
    of 64 KiB and more mapped and unmapped, and the heap top trimmed past 1 MiB, 225 MiB
    (measured with `PeakMemory`). The price is page faults on every new large tensor: the
    demo's iterations took ~1.3-1.6x as long. False where glibc is not the allocator."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """VmHWM of a process (benchmarks read it from outside the training processes)."""
    kib = _status_kib("VmHWM", pid)
    return None if kib is None else kib * 1024

"""Peak memory of this rank's device since a starting point, as the run reports it.

Why it exists: `--dcp-device-memory` is a promise (every replica's peak stays within the
budget) and a promise needs a measurement next to it. On a GPU the measurement is the
caching allocator's own peak (`torch.cuda.max_memory_allocated`). A CPU rank has no
device: its "device memory" is the resident memory the process gains after the start
point (the model state, activations, allocator slack), read from the kernel: the peak
resident size (VmHWM), reset at the start through /proc/self/clear_refs where Linux
allows it, minus the resident size then (code and libraries, which a GPU machine keeps
in host memory). Elsewhere `getrusage`'s lifetime peak is the fallback (an upper bound).
"""
from __future__ import annotations

import resource

import torch

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
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

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = 0
            return
        _reset_resident_peak()
        rss = _status_kib("VmRSS")
        self.baseline = (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _status_kib("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, hwm * 1024 - self.baseline)

    @property
    def what(self) -> str:
        return ("allocator peak" if self.device.type == "cuda"
                else f"resident peak above the {self.baseline / 2**20:.0f} MiB at start")


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """VmHWM of a process (benchmarks read it from outside the training processes)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


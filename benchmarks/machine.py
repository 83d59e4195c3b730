"""One line naming the machine a benchmark ran on (benchmarks report figures with it)."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024 / 2**30
    except OSError:
        return 0.0


def describe() -> str:
    return f"{os.cpu_count()} CPU cores ({cpu_model()}), {memory_gib():.0f} GiB RAM, torch CPU, gloo"

"""Every rank's measured peak device memory, said in one line at the end of training.

Why it exists: `--dcp-device-memory` is a budget the planner promises to keep; the static
path has no planner but the same budget question (does this layout fit?). Both paths start
a `PeakMemory` on every rank before the model (or engine) is built and, when training is
over, gather the ranks' peaks to rank 0, which prints

    > peak device memory per rank (MiB, resident peak above the 230 MiB at start): 181 175 190 170 | budget 244 MiB (256MB): within

`within` when every rank's peak is at most the budget, else which ranks exceeded it. The
numbers are what `PeakMemory` measures (GPU: the allocator's peak; CPU: resident memory
gained since the start), so benchmarks can read the line instead of guessing.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from dcp_ext.runtime.device_memory import PeakMemory, return_freed_memory

MiB = 2**20
LINE_PREFIX = "> peak device memory per rank"
# `(256MB)`-style names for budgets: the largest unit that divides the byte count exactly
_UNITS = (("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("KB", 10**3))


def this_device() -> torch.device:
    """The device this rank's tensors live on: its current GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def start_memory_report(budget: tuple[int, str] | None = None) -> PeakMemory:
    """Call on every rank before the model/engine is built: the peak counts from here. A CPU
    run under a budget (`budget_bytes`) returns freed memory to the OS from here on
    (`return_freed_memory`), so the budget is held by what the tensors need, not by malloc's cache."""
    device = this_device()
    if device.type == "cpu" and budget is not None:
        return_freed_memory()
    return PeakMemory(device)


def budget_bytes(size: int | None, gb: float | None) -> tuple[int, str] | None:
    """(bytes, how the line names it) from --dcp-device-memory (`size`) or
    --dcp-device-memory-gb (`gb`); None without either."""
    if size is not None:
        return int(size), size_text(int(size))
    if gb is not None:
        return int(gb * 2**30), f"--dcp-device-memory-gb {gb:g}"
    return None


def size_text(n: int) -> str:
    """256000000 -> '256MB', 1073741824 -> '1GiB', 1234 -> '1234 bytes'."""
    for unit, scale in _UNITS:
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n} bytes"


def memory_line(peaks: list[int], what: str, budget: tuple[int, str] | None) -> str:
    """The report line for these per-rank peaks (bytes, rank order)."""
    line = f"{LINE_PREFIX} (MiB, {what}): " + " ".join(f"{p / MiB:.0f}" for p in peaks)
    if budget is None:
        return line
    limit, name = budget
    over = [(r, p) for r, p in enumerate(peaks) if p > limit]
    verdict = "within" if not over else "exceeded by " + ", ".join(
        f"rank {r} ({p / MiB:.0f} MiB)" for r, p in over)
    return f"{line} | budget {limit / MiB:.0f} MiB ({name}): {verdict}"


def report_memory(budget: tuple[int, str] | None, peak: PeakMemory | None) -> str | None:
    """Call on every rank after training: gathers the peaks; rank 0 prints and returns the
    line, with the verdict against `budget` (`budget_bytes`) when there is one."""
    if peak is None:
        return None
    mine = peak.peak_bytes()
    if dist.is_initialized() and dist.get_world_size() > 1:
        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, mine)
    else:
        peaks = [mine]
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    line = memory_line([int(p) for p in peaks], peak.what, budget)
    print(line, flush=True)
    return line


_PARSE = re.compile(re.escape(LINE_PREFIX) + r" \(MiB, (?P<what>[^)]*)\): (?P<peaks>[\d ]+?)"
                    r"(?: \| budget (?P<budget>\d+) MiB \((?P<name>[^)]*)\): (?P<verdict>.*))?$", re.M)


def parse_memory_line(text: str) -> dict | None:
    """The last report line in `text` (a run's stdout) as {peaks_mib, what, budget_mib, within}; None if absent."""
    found = list(_PARSE.finditer(text))
    if not found:
        return None
    m = found[-1]
    budget = m.group("budget")
    return {"peaks_mib": [int(x) for x in m.group("peaks").split()], "what": m.group("what"),
            "budget_mib": int(budget) if budget is not None else None,
            "within": None if budget is None else m.group("verdict").strip() == "within"}

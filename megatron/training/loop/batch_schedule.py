"""Upstream's `--step-batch-size-schedule`: the global batch size as a step function of the
samples trained so far.

Why a module of its own: both training loops (static micro-batches, `--dcp` token budgets),
the LR schedule and `--train-samples` read the same schedule, and upstream's semantics are
exact enough to be worth writing once. Upstream (megatron.core's num_microbatches_calculator):
"THRESHOLD:SIZE THRESHOLD:SIZE ..." (commas also separate entries), thresholds and sizes take
K/M/B/T suffixes, thresholds count tokens and become samples by `// --seq-length`, sorted; the
first threshold must be 0, thresholds strictly increase, sizes are positive. An iteration trains
the size of the last entry whose threshold the samples consumed before it reached.

Since the consumed samples only grow by the sizes the schedule gives, the size of iteration k
is a function of k alone (`size_of_iteration`): a resumed run and the `--dcp` batches drawn ahead
of time need no other state. Here an iteration's samples always count, whether or not its update
was applied (as upstream's consumed-samples counter).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class ScheduleError(ValueError):
    pass


def _number(text: str, what: str, entry: str) -> int:
    t = text.strip().upper()
    scale = SUFFIXES.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ScheduleError(f"entry {entry!r}: {what} {text!r} is not a number (suffixes K, M, B, T)") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ScheduleError(f"entry {entry!r}: {what} {text!r} is not a finite number")
    return int(value)


def parse(text: str, seq_length: int) -> list[tuple[int, int]]:
    """[(threshold in samples, global batch size)], sorted, as upstream reads the string."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ScheduleError("is empty: write THRESHOLD:SIZE entries, e.g. \"0:16 2.4B:320\"")
    out = []
    for entry in entries:
        if ":" not in entry:
            raise ScheduleError(f"entry {entry!r} is not THRESHOLD:SIZE (thresholds in tokens, e.g. 0:16 2.4B:320)")
        threshold, size = entry.split(":", 1)
        out.append((_number(threshold, "threshold", entry) // seq_length, _number(size, "size", entry)))
    out.sort(key=lambda e: e[0])
    if out[0][0] != 0:
        raise ScheduleError(f"its first threshold is {out[0][0]} samples: the schedule must start at 0")
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            raise ScheduleError(f"thresholds must strictly increase (in samples of --seq-length {seq_length}); "
                                f"two entries fall on {a}")
    bad = [size for _, size in out if size < 1]
    if bad:
        raise ScheduleError(f"batch size {bad[0]} must be >= 1")
    return out


class BatchSchedule:
    def __init__(self, entries: list[tuple[int, int]]):
        self.entries = entries
        self._thresholds = [t for t, _ in entries]
        # iteration at which each entry takes over, and the samples consumed before it
        self._starts = []  # (first iteration, samples before it)
        iteration, samples = 0, 0
        for i, (_, size) in enumerate(entries):
            self._starts.append((iteration, samples))
            if i + 1 < len(entries):
                steps = max(0, -(-(entries[i + 1][0] - samples) // size))  # iterations until the next threshold
                iteration, samples = iteration + steps, samples + steps * size

    def __repr__(self) -> str:  # compared across ranks (job_agreement) and shown: the entries, in samples
        return f"BatchSchedule({self.entries})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BatchSchedule) and other.entries == self.entries

    @property
    def sizes(self) -> list[int]:
        return [size for _, size in self.entries]

    @property
    def final_size(self) -> int:
        return self.entries[-1][1]

    def size_at(self, consumed_samples: int) -> int:
        return self.entries[max(0, bisect_right(self._thresholds, consumed_samples) - 1)][1]

    def _entry_of_iteration(self, k: int) -> int:
        return max(0, bisect_right([first for first, _ in self._starts], k) - 1)

    def samples_before(self, k: int) -> int:
        """Samples consumed by iterations 0..k-1."""
        i = self._entry_of_iteration(k)
        first, samples = self._starts[i]
        return samples + (k - first) * self.entries[i][1]

    def size_of_iteration(self, k: int) -> int:
        return self.entries[self._entry_of_iteration(k)][1]

    def iterations_for(self, train_samples: int) -> int:
        """Upstream's count for --train-samples: iterations until the samples consumed reach it."""
        lo, hi = 0, max(0, train_samples)  # every iteration consumes at least one sample
        while lo < hi:
            mid = (lo + hi) // 2
            if self.samples_before(mid) >= train_samples:
                hi = mid
            else:
                lo = mid + 1
        return lo

@dataclass(frozen=True)
class GlobalBatchSizes:
    """The global batch size of every iteration: --global-batch-size, or the schedule's
    (read from the flags once: `flags.records.batch_sizes_for`)."""

    size: int  # --global-batch-size (a schedule's final size)
    schedule: BatchSchedule | None = None  # --step-batch-size-schedule, parsed

    def of_iteration(self, k: int) -> int:
        return self.schedule.size_of_iteration(k) if self.schedule is not None else self.size

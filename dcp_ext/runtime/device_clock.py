"""How long spans of a step took on the device, read once per step.

Why it exists: on a GPU, kernels and NCCL transfers run asynchronously, so a host clock
around them measures their launch (about 0), not their time. The clock records CUDA events
around each span on the compute stream instead, and reads them all after one
synchronisation, when the step is over (`seconds`): that is the step's one documented wait
for its timings. A span around a transfer's `wait()` measures how long the compute stream
stood waiting for it: the communication the step exposed. Without CUDA (gloo on CPU ranks,
where every op is synchronous) the same spans use the host clock.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class DeviceClock:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._host: dict = defaultdict(float)
        self._events: list[tuple] = []

    @contextmanager
    def span(self, key):
        """Time the block under `key` (spans of one key add up)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((key, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host[key] += time.perf_counter() - t0

    def timing(self, index: int):
        """A micro-batch's forward or backward compute (the executor's spans)."""
        return self.span(index)

    def seconds(self) -> dict:
        """Seconds per key; on CUDA waits once for the device, then reads every event."""
        out = dict(self._host)
        if self._events:
            self._events[-1][2].synchronize()  # the last event recorded: every earlier one is done
            for key, start, end in self._events:
                out[key] = out.get(key, 0.0) + start.elapsed_time(end) / 1000.0
            self._events.clear()
        self._host.clear()
        return out

    @staticmethod
    def per_index(seconds: dict, count: int) -> list[float]:
        """The integer keys 0..count-1 of `seconds` as a list (the micro-batches' times)."""
        return [seconds.get(i, 0.0) for i in range(count)]

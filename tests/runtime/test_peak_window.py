"""The per-step memory window that online recalibration reads (dcp_ext.runtime.device_memory):
each window its own peak, the run's peak the largest of them."""
import time

import pytest
import torch

from dcp_ext.runtime.device_memory import PeakMemory


def test_each_window_holds_its_own_peak_and_the_run_keeps_the_largest():
    peak = PeakMemory(torch.device("cpu"), interval_s=0.001)
    if not peak.sampled:
        pytest.skip("no RssAnon in /proc/self/status here")
    peak.window_peak_bytes()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
    time.sleep(0.05)
    del big
    first = peak.window_peak_bytes()
    small = torch.ones(8 * 2**20 // 4)
    time.sleep(0.05)
    second = peak.window_peak_bytes()
    del small
    assert first >= 60 * 2**20
    assert second < first - 40 * 2**20  # the big tensor's window is over
    assert peak.peak_bytes() >= first

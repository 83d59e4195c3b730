"""The end-of-training memory line: every rank's measured peak, the budget, the verdict.

On 4 gloo ranks one rank allocates a known amount of tensors: its number must be at least
what it allocated and the idle ranks' must stay well below, a generous budget says
`within`, a budget below the allocation names exactly the rank that exceeded it. Then one
short run of the real entry point (static and --dcp on one rank each) must end with the line.
"""

import pytest

from megatron.training.loop.memory_report import memory_line, parse_memory_line, size_text
from tests.conftest import TINY_MODEL
from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

MiB = 2**20
ALLOC_MIB = 100


def _allocate_and_report(rank, world_size):
    import torch

    from megatron.training.loop.memory_report import budget_bytes, report_memory, start_memory_report

    lines = []
    # a generous budget (1 GiB): rank 2 allocates 100 MiB of tensors
    peak = start_memory_report()
    held = torch.ones(ALLOC_MIB * MiB // 4) if rank == 2 else None
    lines.append(report_memory(budget_bytes(2**30, None), peak))
    del held
    # a budget below the allocation (50MB): rank 1 allocates, from a fresh start point
    peak = start_memory_report()
    held = torch.ones(ALLOC_MIB * MiB // 4) if rank == 1 else None
    lines.append(report_memory(budget_bytes(50 * 10**6, None), peak))
    del held
    return lines


def test_peaks_of_every_rank_and_the_budget_verdict():
    (within, over), *others = run_ranks(4, fn=_allocate_and_report, timeout=120)
    assert all(lines == [None, None] for lines in others), "only rank 0 prints the line"

    got = parse_memory_line(within)
    assert len(got["peaks_mib"]) == 4, within
    assert got["peaks_mib"][2] >= 0.95 * ALLOC_MIB, within
    assert max(got["peaks_mib"][r] for r in (0, 1, 3)) < ALLOC_MIB / 2, within  # idle ranks: no 100 MiB
    assert got["budget_mib"] == 1024 and got["within"] is True, within
    assert "(1GiB): within" in within and "resident peak above the" in within

    got = parse_memory_line(over)
    assert got["peaks_mib"][1] >= 0.95 * ALLOC_MIB and got["within"] is False, over
    assert got["budget_mib"] == 48, over  # 50e6 bytes
    assert "(50MB): exceeded by rank 1 (" in over and "rank 0" not in over and "rank 2" not in over, over


def test_line_format_round_trips():
    line = memory_line([181 * MiB, 175 * MiB, 190 * MiB + 1, 170 * MiB], "allocator peak", (256 * 10**6, "256MB"))
    assert line == ("> peak device memory per rank (MiB, allocator peak): 181 175 190 170 | "
                    "budget 244 MiB (256MB): within")
    assert parse_memory_line("noise\n" + line + "\nmore") == {
        "peaks_mib": [181, 175, 190, 170], "what": "allocator peak", "budget_mib": 244, "within": True}
    assert parse_memory_line(memory_line([5 * MiB], "x", None))["budget_mib"] is None
    assert [size_text(n) for n in (256 * 10**6, 2**30, 3 * 2**20, 1234)] == ["256MB", "1GiB", "3MiB", "1234 bytes"]


@pytest.mark.parametrize("path", ["static", "dcp"])
def test_both_training_paths_end_with_the_line(path, text_corpus, tmp_path):
    flags = TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path), "--micro-batch-size", "2",
                          "--global-batch-size", "2", "--train-iters", "1", "--dcp-device-memory", "1GiB"]
    if path == "dcp":
        flags += ["--dcp", "--dcp-global-batch-tokens", "256"]
    r = run_ranks(1, flags, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = parse_memory_line(r.stdout)
    assert got is not None, r.stdout[-2000:]
    assert len(got["peaks_mib"]) == 1 and got["budget_mib"] == 1024 and got["within"] is True, r.stdout[-2000:]

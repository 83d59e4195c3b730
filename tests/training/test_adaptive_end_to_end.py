"""The adaptive runtime end to end through pretrain_gpt_dcp.py.

The CPU demo with --dcp --dcp-planner adaptive switches layouts and its losses equal those
of --dcp-planner static (same seed, same data) at each of the first 20 iterations; a
checkpoint saved on 4 ranks resumes exactly on 4 ranks and within float rounding on 2 and
on 8 ranks. The uninterrupted adaptive run (conftest's `adaptive_demo`) is the reference of
every comparison.
"""
import os
import shutil

import pytest

from tests.conftest import demo_flags
from tests.support.helpers import read_loss_log, run_ranks

pytestmark = pytest.mark.dist


def test_adaptive_switches_layouts_and_matches_static(demo_cache, adaptive_demo, tmp_path):
    log, plans = str(tmp_path / "static.jsonl"), str(tmp_path / "static.plans")
    r = run_ranks(4, demo_flags(demo_cache, "static", 20, log, plans))
    assert r.returncode == 0, r.stderr[-3000:]
    adaptive, static = adaptive_demo.losses, read_loss_log(log)
    assert len(adaptive) == len(static) == 20
    for a, s in zip(adaptive, static):
        assert a["lm loss"] == pytest.approx(s["lm loss"], rel=1e-4), (a, s)
    layouts = [tuple(sorted((x["tp"], x["cp"], x["pp"]) for x in it["replicas"])) for it in adaptive_demo.plans.values()]
    assert len(set(layouts)) >= 2, "the adaptive planner never changed layout"
    assert adaptive[-1]["lm loss"] < adaptive[0]["lm loss"] - 0.5  # it learns


def test_every_process_group_is_created_before_the_first_iteration(adaptive_demo):
    """On NCCL a communicator costs seconds and every rank must create it in the same order:
    the runtime creates each group its pool may need at start, none while it trains, though
    the run changes layout and saves checkpoints every 3 iterations
    (tests/support/group_count_entry.py counts new_group/new_subgroups calls from outside)."""
    layouts = {tuple(sorted((x["tp"], x["cp"], x["pp"]) for x in it["replicas"])) for it in adaptive_demo.plans.values()}
    assert len(layouts) >= 2, "the run never changed layout: nothing to create a group for"
    created = adaptive_demo.groups
    assert all(created[r] for r in range(4)), "no creation recorded: the count saw nothing"
    assert len({len(created[r]) for r in range(4)}) == 1, {r: len(c) for r, c in created.items()}
    late = {r: [c for c in created[r] if c["iterations_done"] > 0] for r in range(4)}
    assert not any(late.values()), late


def checkpoint_at(saved: str, iteration: int, into: str) -> str:
    """A checkpoint folder holding only `saved`'s iteration `iteration` (Megatron's layout:
    iter_NNNNNNN/ and the tracker naming it)."""
    os.makedirs(into)
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(saved, name), os.path.join(into, name))
    with open(os.path.join(into, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return into


def test_adaptive_checkpoint_resumes_exactly_and_on_other_world_sizes(demo_cache, adaptive_demo, tmp_path):
    losses, saved = adaptive_demo.losses, adaptive_demo.ckpt
    save = checkpoint_at(saved, 3, str(tmp_path / "ckpt"))  # saved on 4 ranks by the reference run
    reference = losses[3:6]
    for nproc in (4, 2, 8):
        log = str(tmp_path / f"resume{nproc}.jsonl")
        r = run_ranks(nproc, demo_flags(demo_cache, "adaptive", 20, log) + ["--load", save, "--exit-interval", "6"])
        assert r.returncode == 0, r.stderr[-3000:]
        resumed = read_loss_log(log)
        assert [x["iteration"] for x in resumed] == [4, 5, 6]
        for got, want in zip(resumed, reference):
            if nproc == 4:
                assert got["lm loss"] == want["lm loss"], (got, want)
            else:
                assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5)

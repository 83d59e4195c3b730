"""Reliability of the adaptive runtime: kill -9 and restart.

A 4-rank `--dcp` run is killed (SIGKILL, one worker) at a random iteration; torchrun
(`--max-restarts 1`) restarts it from the last checkpoint, and every later loss equals the
uninterrupted run's (conftest's `adaptive_demo`) bit for bit, with the same plans. Resuming
a 4-rank checkpoint on 2 and on 8 ranks is test_dcp_training's.
"""
import os
import random
import signal
import time

import pytest

from tests.conftest import demo_flags
from tests.support.helpers import ENTRY, kill_tree, rank_processes, read_loss_log, read_plan_log, start_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a 12-iteration run killed and restarted: ~40 s


def last_by_iteration(records):
    return {r["iteration"]: r for r in records}


def test_kill_9_and_torchrun_restart_resume_exactly(demo_cache, adaptive_demo, tmp_path):
    kill_at = random.Random(1234).randint(4, 10)
    save = str(tmp_path / "ckpt")
    log, plans = str(tmp_path / "loss.jsonl"), str(tmp_path / "plans.jsonl")
    flags = demo_flags(demo_cache, "adaptive", 12, log, plans) + ["--save", save, "--load", save,
                                                                  "--save-interval", "3"]
    with open(tmp_path / "out.txt", "w") as out:
        proc = start_ranks(4, flags, out, max_restarts=1)
        try:
            killed = False
            deadline = time.time() + 600
            while proc.poll() is None and time.time() < deadline:
                if not killed and os.path.exists(log) and len(read_loss_log(log)) >= kill_at:
                    workers = rank_processes(proc, ENTRY)
                    os.kill(workers[-1].pid, signal.SIGKILL)
                    killed = True
                time.sleep(0.2)
            code = proc.wait(timeout=max(1, deadline - time.time()))
        finally:
            kill_tree(proc)
    assert killed, "the run ended before it could be killed"
    assert code == 0, open(tmp_path / "out.txt").read()[-3000:]
    want_losses, want_plans = adaptive_demo.losses, adaptive_demo.plans
    got = last_by_iteration(read_loss_log(log))
    resumed_from = 3 * ((kill_at) // 3)
    assert sorted(got) == list(range(1, 13))
    for record in want_losses[:12]:
        assert got[record["iteration"]]["lm loss"] == record["lm loss"], (kill_at, record["iteration"])
        assert got[record["iteration"]]["grad norm"] == record["grad norm"]
    got_plans = read_plan_log(plans)
    for index in range(resumed_from, 12):
        assert got_plans[index]["replicas"] == want_plans[index]["replicas"], index

"""Reliability of the adaptive runtime (issue 6): kill -9 and restart, resume on 2 and 8 ranks.

A 4-rank `--dcp` run is killed (SIGKILL, one worker) at a random iteration; torchrun
(`--max-restarts 1`) restarts it from the last checkpoint, and every later loss equals the
uninterrupted run's bit for bit, with the same plans. A checkpoint saved on 4 ranks also
resumes on 2 and on 8 ranks (same losses within float rounding).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ENTRY, REPO, launch, read_loss_log
from tests.test_dcp_training import demo_flags

pytestmark = pytest.mark.dist


def plans_by_index(path):
    plans = {}
    with open(path) as f:
        for line in f:
            it = json.loads(line)
            plans[it["index"]] = it  # a restarted run re-logs: the last one counts
    return plans


def last_by_iteration(records):
    return {r["iteration"]: r for r in records}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp_cache"))


@pytest.fixture(scope="module")
def unbroken(cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("unbroken")
    log, plans = str(root / "loss.jsonl"), str(root / "plans.jsonl")
    r = launch(demo_flags(cache, "adaptive", 12, log, plans), nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_loss_log(log), plans_by_index(plans)


def test_kill_9_and_torchrun_restart_resume_exactly(cache, unbroken, tmp_path):
    kill_at = random.Random(1234).randint(4, 10)
    save = str(tmp_path / "ckpt")
    log, plans = str(tmp_path / "loss.jsonl"), str(tmp_path / "plans.jsonl")
    flags = demo_flags(cache, "adaptive", 12, log, plans) + ["--save", save, "--load", save, "--save-interval", "3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--max-restarts=1",
           ENTRY] + flags
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            killed = False
            deadline = time.time() + 600
            while proc.poll() is None and time.time() < deadline:
                if not killed and os.path.exists(log) and len(read_loss_log(log)) >= kill_at:
                    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                               if ENTRY in " ".join(p.cmdline())]
                    os.kill(workers[-1].pid, signal.SIGKILL)
                    killed = True
                time.sleep(0.2)
            code = proc.wait(timeout=max(1, deadline - time.time()))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert killed, "the run ended before it could be killed"
    assert code == 0, open(tmp_path / "out.txt").read()[-3000:]
    want_losses, want_plans = unbroken
    got = last_by_iteration(read_loss_log(log))
    resumed_from = 3 * ((kill_at) // 3)
    assert sorted(got) == list(range(1, 13))
    for record in want_losses:
        assert got[record["iteration"]]["lm loss"] == record["lm loss"], (kill_at, record["iteration"])
        assert got[record["iteration"]]["grad norm"] == record["grad norm"]
    got_plans = plans_by_index(plans)
    for index in range(resumed_from, 12):
        assert got_plans[index]["replicas"] == want_plans[index]["replicas"], index


@pytest.mark.parametrize("nproc", [2, 8])
def test_checkpoint_from_4_ranks_resumes_on_other_world_sizes(cache, unbroken, tmp_path, nproc):
    save = str(tmp_path / "ckpt")
    r = launch(demo_flags(cache, "adaptive", 12, str(tmp_path / "a.jsonl")) +
               ["--save", save, "--save-interval", "6", "--exit-interval", "6"], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    log = str(tmp_path / "b.jsonl")
    r = launch(demo_flags(cache, "adaptive", 9, log) + ["--load", save], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    want = last_by_iteration(unbroken[0])
    resumed = read_loss_log(log)
    assert [x["iteration"] for x in resumed] == [7, 8, 9]
    for got in resumed:
        assert got["lm loss"] == pytest.approx(want[got["iteration"]]["lm loss"], rel=1e-5)

"""Two nodes on one machine: a launcher that dies, and an output given to one node only (issue 37, class D).

Two torchrun launchers (`--nnodes 2 --node-rank 0|1`, a static rendezvous on localhost, one
rank each) train one --dcp job. Node 1's launcher is killed (SIGKILL) while its worker lives
on. Before: the worker kept training unsupervised, and node 0 waited five minutes at the end
and exited 0 with a torch elastic traceback. Now node 1's worker sees its parent gone, says
so in one line and stops; node 0's rank loses contact and names rank 1 and why it stopped;
node 0's launcher exits non-zero at once.

`--loss-log` is given to node 0 only: the last rank (node 1's) writes it, so nothing would be
written; rank 0 says so in one line at start.
"""
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import ENTRY, REPO, free_port, kill_tree, rank_env, rank_processes

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # two launchers, a few iterations: ~40 s


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^(\[rank \d+\] )?error: ", line)]


def test_a_killed_launcher_stops_its_ranks_and_the_job_in_one_line_each(text_corpus, tmp_path):
    log = str(tmp_path / "loss.jsonl")
    flags = TINY_MODEL + ["--dcp", "--dcp-global-batch-tokens", "1024", "--train-iters", "100000", "--lr-decay-iters",
                          "100000", "--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                          "--distributed-timeout-minutes", "1"]
    port = free_port()
    procs, files, worker = [], [], None
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                   "--nproc_per_node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
                   ENTRY] + flags + (["--loss-log", log] if node == 0 else [])
            out, err = open(tmp_path / f"out{node}", "w"), open(tmp_path / f"err{node}", "w")
            files += [out, err]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env(), stdout=out, stderr=err, text=True,
                                          start_new_session=True))
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if re.search(r"iteration +3/", open(tmp_path / "out1").read()):  # the last rank prints the lines
                break
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), open(tmp_path / "err0").read()[-3000:]
        worker, = rank_processes(procs[1], ENTRY)
        launcher = procs[1].pid
        os.kill(launcher, signal.SIGKILL)
        killed_at = time.time()
        try:
            code0 = procs[0].wait(timeout=120)
        except subprocess.TimeoutExpired:
            code0 = None
        took = time.time() - killed_at
        try:
            worker.wait(timeout=60)
            worker_ended = True
        except psutil.TimeoutExpired:
            worker_ended = False
    finally:
        for p in procs:
            kill_tree(p)
        if worker is not None:
            try:
                worker.kill()
            except psutil.Error:
                pass
        for f in files:
            f.close()
    err0, err1, out0 = (open(tmp_path / name).read() for name in ("err0", "err1", "out0"))
    print(f"node 0's launcher exited {code0} {took:.0f} s after node 1's launcher was killed")
    assert code0 is not None and code0 != 0, (code0, err0[-3000:])
    assert took < 60, took
    assert worker_ended, "node 1's worker trains on without its launcher"
    assert error_lines(err1) == [f"[rank 1] error: the launcher of this node (torchrun, pid {launcher}) is gone: "
                                 "rank 1 stops (nothing would restart, stop or report it); see why the launcher died "
                                 "(killed, out of memory), then rerun the job to resume from the last checkpoint"], err1
    lost, = error_lines(err0)
    assert lost.startswith(f"[rank 0] error: lost contact with rank 1 (pid {worker.pid} on "), lost
    assert f"which stopped: its node's launcher (torchrun, pid {launcher} on " in lost, lost
    assert "Traceback" not in err1, err1[-3000:]
    said = [line for line in out0.splitlines() if "--loss-log" in line]
    assert said == [f"WARNING: --loss-log {log} (given to rank 0) is written only by rank 1 (the last rank, on "
                    f"{os.uname().nodename}), which was not given --loss-log: it will not be written; pass --loss-log "
                    "to every node's launcher"], said
    assert not os.path.exists(log)

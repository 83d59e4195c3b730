"""SIGINT (Ctrl-C) ends a run in one line, like SIGTERM without --exit-signal-handler
(issue 24, class F): it used to print 49-124 lines of traceback, under torchrun too. The
line says where the run can resume."""
import contextlib
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import ENTRY, kill_tree, rank_processes, read_loss_log, start_ranks
from tests.training.test_bad_inputs import _worker_lines

pytestmark = pytest.mark.dist

PATHS = {"static": ["--micro-batch-size", "2", "--global-batch-size", "4"],
         "dcp": ["--dcp", "--dcp-global-batch-tokens", "512"]}


def interrupt_after_a_save(nproc, path, corpus, tmp_path):
    """Start a run that saves every 2 iterations, SIGINT every rank after iteration 3: (code, stderr)."""
    log, save = str(tmp_path / "loss.jsonl"), str(tmp_path / "ckpt")
    flags = TINY_MODEL + PATHS[path] + ["--train-iters", "100000", "--lr-decay-iters", "100000", "--data-path", corpus,
                                        "--data-cache-path", str(tmp_path / "cache"), "--loss-log", log,
                                        "--save", save, "--save-interval", "2"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = start_ranks(nproc, flags, out, err, env={"PYTHONFAULTHANDLER": "1"})
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if os.path.exists(log) and len(read_loss_log(log)) >= 3:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, open(tmp_path / "err").read()[-3000:]
            ranks = [proc.pid] if nproc == 1 else [p.pid for p in rank_processes(proc, ENTRY)]
            for pid in ranks:  # what Ctrl-C in a terminal, or `kill -INT` to the job, delivers
                os.kill(pid, signal.SIGINT)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:  # hung after SIGINT: where each thread is (faulthandler)
                for pid in ranks:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGABRT)
                time.sleep(5)
                raise AssertionError("no exit 120 s after SIGINT; stacks:\n" + open(tmp_path / "err").read()[-8000:])
        finally:
            kill_tree(proc)
    return code, open(tmp_path / "err").read(), save


@pytest.mark.parametrize("path", ["static", "dcp"])
def test_ctrl_c_is_one_line_naming_the_last_checkpoint(path, text_corpus, tmp_path):
    code, stderr, save = interrupt_after_a_save(1, path, text_corpus, tmp_path)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 130, (code, stderr[-3000:])
    assert "Traceback" not in stderr and len(lines) == 1, stderr[-3000:]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        last = f.read().strip()
    assert lines[0].startswith("error: interrupted (SIGINT, Ctrl-C)")
    assert f"its last checkpoint in --save {save} is iteration {last}" in lines[0]


def test_ctrl_c_under_torchrun_is_one_line_from_the_ranks(text_corpus, tmp_path):
    code, stderr, _ = interrupt_after_a_save(2, "dcp", text_corpus, tmp_path)
    assert code != 0
    lines = _worker_lines(stderr)  # torchrun's own failure report (its log lines) set aside
    assert "Traceback" not in "\n".join(lines), "\n".join(lines)[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (SIGINT, Ctrl-C)"), lines

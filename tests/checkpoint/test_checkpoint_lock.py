"""megatron/training/checkpoint/lock.py: one job per --save directory.

Unit tests drive the lock directly with fake holder records (a live pid, a dead one, a
reused one, another host, a copied directory, a damaged file); the `dist` tests run real
jobs: two on one --save (the second refuses before training, the first finishes with its
checkpoints), a holder killed with SIGKILL (the next job takes its lock over, saying so),
and the lock given back after a normal end, SIGTERM and an error exit.
"""
import json
import os
import signal
import socket
import time

import pytest

from megatron.training.checkpoint import lock as lock
from megatron.training.startup import stop_signals
from megatron.training.checkpoint.lock import LOCK_NAME, CheckpointLockError
from tests.conftest import TINY_MODEL
from tests.support.helpers import kill_tree, rank_processes, read_loss_log, run_ranks, start_ranks
from tests.support.helpers import assert_one_line_error

DEAD_PID = 4194304 + 4321  # above Linux's largest pid_max: never a running process


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(lock, "SETTLE_S", 0.0)
    yield
    lock.release()
    lock._held = None


def write_record(save, **fields):
    os.makedirs(save, exist_ok=True)
    record = {"host": socket.gethostname(), "pid": os.getppid(), "start": lock.process_start(os.getppid()),
              "since": time.time() - 60, "command": "pretrain_gpt_dcp.py --save x", "dir": os.path.realpath(save),
              "token": "theirs"}
    record.update(fields)
    with open(os.path.join(save, LOCK_NAME), "w") as f:
        json.dump(record, f)
    return record


def read_lock(save):
    with open(os.path.join(save, LOCK_NAME)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------- unit
def test_take_names_this_process_and_release_gives_it_back(tmp_path):
    save = str(tmp_path / "ckpt")
    assert lock.take(save) is None
    record = read_lock(save)
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert record["start"] == lock.process_start(os.getpid()) and record["start"]
    assert record["dir"] == os.path.realpath(save) and record["command"]
    assert lock.take(save) is None  # already ours: nothing changes
    assert read_lock(save)["token"] == record["token"]
    lock.release()
    assert not os.path.exists(save)  # made for the lock and left empty: removed with it
    lock.release()  # twice is harmless


def test_release_keeps_a_directory_it_did_not_make(tmp_path):
    lock.take(str(tmp_path))
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_live_holder_is_named_and_its_lock_kept(tmp_path):
    save = str(tmp_path)
    theirs = write_record(save)
    with pytest.raises(CheckpointLockError) as e:
        lock.take(save)
    line = str(e.value)
    assert line.startswith(f"--save {save}: in use by another training job (pid {os.getppid()} on host "
                           f"{socket.gethostname()}, since ")
    assert "pretrain_gpt_dcp.py --save x" in line and "point --save to another directory" in line
    assert "\n" not in line
    assert read_lock(save) == theirs
    lock.release()
    assert read_lock(save) == theirs  # refused: never ours to give back


def test_a_dead_holder_is_taken_over_with_a_note(tmp_path):
    save = str(tmp_path)
    write_record(save, pid=DEAD_PID, start="x:1")
    note = lock.take(save)
    assert note.startswith(f"note: taking over the stale lock of pid {DEAD_PID} on {socket.gethostname()}")
    assert "it is no longer running" in note
    assert read_lock(save)["pid"] == os.getpid()
    assert sorted(os.listdir(save)) == [LOCK_NAME]  # nothing left aside


def test_a_reused_pid_is_stale(tmp_path):
    write_record(str(tmp_path), start="another:12345")  # our parent's pid, another start
    note = lock.take(str(tmp_path))
    assert "its pid now belongs to another process" in note


def test_a_lock_from_another_host_is_refused_with_the_file_to_remove(tmp_path):
    save = str(tmp_path)
    write_record(save, host="node-17", pid=DEAD_PID)
    with pytest.raises(CheckpointLockError) as e:
        lock.take(save)
    line = str(e.value)
    assert f"pid {DEAD_PID} on host node-17" in line and "cannot check" in line
    assert f"remove {os.path.join(save, LOCK_NAME)} and rerun" in line
    assert read_lock(save)["host"] == "node-17"


def test_an_earlier_attempt_of_the_same_torchrun_job_is_stale_wherever_it_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    write_record(str(tmp_path / "a"), host="node-17", run="job-42", attempt=0)  # rank 0 was on a lost node
    note = lock.take(str(tmp_path / "a"))
    assert "left by attempt 0 of this torchrun job" in note
    assert read_lock(str(tmp_path / "a"))["run"] == "job-42" and read_lock(str(tmp_path / "a"))["attempt"] == 1
    lock.release()
    write_record(str(tmp_path / "b"), host="node-17", run="another-job", attempt=0)
    with pytest.raises(CheckpointLockError, match="cannot check"):
        lock.take(str(tmp_path / "b"))
    write_record(str(tmp_path / "c"), host="node-17", run="job-42", attempt=1)  # the same attempt: not stale
    with pytest.raises(CheckpointLockError, match="cannot check"):
        lock.take(str(tmp_path / "c"))


def test_a_copied_lock_does_not_hold_the_copy(tmp_path):
    write_record(str(tmp_path / "copy"), dir=str(tmp_path / "original"))
    note = lock.take(str(tmp_path / "copy"))
    assert "a copy" in note and read_lock(str(tmp_path / "copy"))["pid"] == os.getpid()


@pytest.mark.parametrize("content,why", [("", "empty"), ("{not json", "not a lock record")])
def test_an_unreadable_lock_is_refused(tmp_path, content, why):
    (tmp_path / LOCK_NAME).write_text(content)
    with pytest.raises(CheckpointLockError) as e:
        lock.take(str(tmp_path))
    assert f"cannot be read ({why})" in str(e.value) and "remove" in str(e.value)
    assert (tmp_path / LOCK_NAME).read_text() == content


def test_judge_by_pid_and_start():
    here = socket.gethostname()
    record = {"host": here, "pid": 123, "start": "b:1", "dir": None}
    assert lock.judge(record, "/x", here, start_of=lambda pid: "b:1") == ("live", "")
    assert lock.judge(record, "/x", here, start_of=lambda pid: None)[0] == "stale"
    assert lock.judge(record, "/x", here, start_of=lambda pid: "b:2")[0] == "stale"
    assert lock.judge(record, "/x", here, start_of=lambda pid: "")[0] == "live"  # unknown start: assume alive
    assert lock.judge(dict(record, host="elsewhere"), "/x", here, start_of=lambda pid: None)[0] == "foreign"


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    lock.take(str(tmp_path))
    theirs = write_record(str(tmp_path))  # removed by hand and taken by another job meanwhile
    lock.release()
    assert read_lock(str(tmp_path)) == theirs


def test_release_in_a_forked_child_does_nothing(tmp_path, monkeypatch):
    lock.take(str(tmp_path))
    monkeypatch.setattr(lock._held, "pid", os.getpid() + 1)  # as a child forked from the holder sees it
    lock.release()
    assert os.path.exists(tmp_path / LOCK_NAME)


def test_recover_leaves_the_lock_alone(tmp_path):
    from megatron.training.checkpoint.protocol import recover

    lock.take(str(tmp_path))
    for name in ("iter_0000003.incomplete", "iter_0000002.deleting"):
        os.makedirs(tmp_path / name)
    recover(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]


def test_acquire_without_save_does_nothing(tmp_path):
    lock.acquire(None)
    assert lock._held is None


def test_acquire_refuses_with_the_holders_line(tmp_path):
    write_record(str(tmp_path))
    with pytest.raises(CheckpointLockError, match="in use by another training job"):
        lock.acquire(str(tmp_path))


def test_sigterm_gives_the_lock_back_then_dies_of_it(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(stop_signals.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        lock.acquire(str(tmp_path))
        assert signal.getsignal(signal.SIGTERM) is stop_signals.on_sigterm
        stop_signals.on_sigterm(signal.SIGTERM, None)
        assert not os.path.exists(tmp_path / LOCK_NAME)
        assert killed == [(os.getpid(), signal.SIGTERM)]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("said_why", [False, True])
def test_sigterm_says_why_unless_the_rank_already_did(said_why, monkeypatch, capsys):
    """A rank that printed its error line and is stopped by torchrun while it exits adds no
    second line; one stopped with nothing said prints the SIGTERM line."""
    monkeypatch.setattr(stop_signals.os, "kill", lambda pid, sig: None)
    monkeypatch.setattr(stop_signals, "_reason_given", False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if said_why:
            stop_signals.reason_given()
        stop_signals.on_sigterm(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err == ("" if said_why else stop_signals.SIGTERM_LINE + "\n")


# ------------------------------------------------------------------------------ real jobs
STATIC = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4"]


def _wait(pred, proc, what, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        assert proc.poll() is None, f"the first job ended before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} after {timeout} s")


def _workers(proc):
    return rank_processes(proc, "pretrain_gpt_dcp.py", direct=True)


def _listing(save):
    return sorted(n for n in os.listdir(save) if n != LOCK_NAME)


@pytest.mark.dist
def test_two_jobs_on_one_save_the_second_refuses_before_training(text_corpus, tmp_path):
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "first.jsonl")
    first = STATIC + data + ["--train-iters", "100000", "--save", save, "--save-interval", "2",
                             "--exit-signal-handler", "--loss-log", log]
    with open(tmp_path / "first.out", "w") as out:
        proc = start_ranks(2, first, out)  # torchrun: rank 0 takes the lock, rank 1 learns it
        try:
            _wait(lambda: os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt")), proc,
                  "a checkpoint")
            before = {n: os.stat(os.path.join(save, n)).st_mtime_ns for n in _listing(save)
                      if n.startswith("iter_")}
            second_log = str(tmp_path / "second.jsonl")
            second = STATIC + data + ["--train-iters", "2", "--save", save, "--save-interval", "1",
                                      "--loss-log", second_log]
            r = run_ranks(1, second)
            assert_one_line_error(r, f"--save {save}: in use by another training job (pid ")
            holder = read_lock(save)
            assert f"(pid {holder['pid']} on host {holder['host']}, since " in r.stderr
            assert not os.path.exists(second_log)  # refused before training
            r2 = run_ranks(2, second)  # every rank of a job stops on rank 0's verdict
            assert r2.returncode != 0 and "Traceback" not in r2.stderr, r2.stderr[-3000:]
            lines = [x for x in r2.stderr.splitlines() if x.strip()]
            assert 1 <= len(lines) <= 2 and all("error: --save" in x and "in use by another" in x for x in lines)
            assert read_lock(save) == holder
            for name, mtime in before.items():  # the first job's checkpoints are its own
                path = os.path.join(save, name)
                assert not os.path.exists(path) or os.stat(path).st_mtime_ns == mtime, name
            for worker in _workers(proc):  # as SLURM's preemption does: each rank saves and ends normally
                worker.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=240)
        finally:
            kill_tree(proc)
    text = open(tmp_path / "first.out").read()
    assert code == 0, text[-3000:]
    last = read_loss_log(log)[-1]["iteration"]
    assert [x["iteration"] for x in read_loss_log(log)] == list(range(1, last + 1))
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(last)
    assert not os.path.exists(os.path.join(save, LOCK_NAME))  # given back at the end


@pytest.mark.dist
def test_a_killed_holders_lock_is_taken_over(text_corpus, tmp_path):
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    save = str(tmp_path / "ckpt")
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    flags = STATIC + data + ["--train-iters", "100000", "--save", save, "--save-interval", "2"]
    with open(tmp_path / "first.out", "w") as out:
        proc = start_ranks(1, flags, out)  # plain python: the process is rank 0
        try:
            _wait(lambda: os.path.exists(tracker), proc, "a checkpoint")
            assert read_lock(save)["pid"] == proc.pid
        finally:
            kill_tree(proc)  # SIGKILL: no chance to give the lock back
            proc.wait()
    assert read_lock(save)["pid"] == proc.pid
    saved = int(open(tracker).read())
    log = str(tmp_path / "second.jsonl")
    r = run_ranks(1, STATIC + data + ["--train-iters", str(saved + 1), "--save", save, "--load", save,
                                      "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    notes = [x for x in r.stdout.splitlines() if x.startswith("note: taking over the stale lock")]
    assert len(notes) == 1 and f"of pid {proc.pid} " in notes[0] and "no longer running" in notes[0], notes
    assert [x["iteration"] for x in read_loss_log(log)] == [saved + 1]  # resumed its checkpoint
    assert not os.path.exists(os.path.join(save, LOCK_NAME))


@pytest.mark.dist
def test_sigterm_gives_the_lock_back(text_corpus, tmp_path):
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    flags = STATIC + data + ["--train-iters", "100000", "--save", save, "--loss-log", log]
    with open(tmp_path / "out", "w") as out:
        proc = start_ranks(1, flags, out)
        try:
            _wait(lambda: os.path.exists(log) and read_loss_log(log), proc, "an iteration")
            assert os.path.exists(os.path.join(save, LOCK_NAME))
            proc.send_signal(signal.SIGTERM)  # no --exit-signal-handler: it dies of the signal
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
    assert code == -signal.SIGTERM
    assert not os.path.exists(os.path.join(save, LOCK_NAME))


@pytest.mark.dist
def test_the_lock_is_given_back_after_an_error_exit(text_corpus, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("7")  # fails at the load
    save = tmp_path / "ckpt"
    r = run_ranks(1, STATIC + ["--data-path", text_corpus, "--train-iters", "1", "--save", str(save),
                               "--load", str(tmp_path / "bad")])
    assert_one_line_error(r, "iter_0000007")
    assert not save.exists()  # the lock is gone, and with it the folder made for it
    save.mkdir()
    r = run_ranks(1, STATIC + ["--data-path", text_corpus, "--train-iters", "1", "--save", str(save),
                               "--load", str(tmp_path / "bad")])
    assert_one_line_error(r, "iter_0000007")
    assert os.listdir(save) == []


@pytest.mark.parametrize("rank,speaks", [(0, True), (1, False)])
def test_a_quiet_rank_leaves_rank_0_the_time_to_print_the_error(rank, speaks, monkeypatch, capsys):
    """A flag error every rank meets prints once, on rank 0. A silent rank that exited at
    once made torchrun stop rank 0 before its line came out (CI saw a run with no line):
    the silent rank now waits, rank 0 does not."""
    from megatron.training import training
    from megatron.training.startup import stop_signals

    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    monkeypatch.setattr(stop_signals, "_reason_given", False)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        training._report_error_and_exit("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2", 2,
                                        every_rank=False)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (err == "error: --num-layers 3 is not divisible by --pipeline-model-parallel-size 2\n") == speaks
    assert (err == "") == (not speaks)
    assert slept == ([] if speaks else [training.QUIET_RANK_GRACE_S])
    assert stop_signals.was_reason_given()  # torchrun's SIGTERM adds no line

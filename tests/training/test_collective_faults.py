"""A fault of the job is one line naming who and what (issue 37, classes C and D), unit tier.

The pieces, in one process: the heartbeats' verdict read from a store (liveness.py: a rank
whose counter stands still, a stopped or vanished process on this host, a rank that left
saying why), the line built from a collective's failure (collective_faults.py: gloo's and
NCCL's messages, the collective read from the traceback), and the flag agreement across
ranks (job_agreement.py: the flag that differs and which ranks; where one-rank outputs go).
The real thing, on real ranks, is in test_stalled_rank.py, test_group_timeouts.py,
test_launcher_gone.py and the bad-input table's rank rows.
"""
import argparse
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from megatron.training.flags import job_agreement
from megatron.training.startup import collective_faults, liveness
from megatron.training.startup.collective_faults import fault_line, is_collective_failure, rank_list, timed_out_after_s

GLOO_RECV = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
             "60000ms for recv operation to complete")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:38083")
NCCL_WATCHDOG = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
                 "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before timing out.")


# ------------------------------------------------------------------ which failures
def test_gloo_and_nccl_failures_are_collective_faults_and_others_are_not():
    for text in (GLOO_RECV, GLOO_CLOSED, NCCL_WATCHDOG, "Connection reset by peer"):
        assert is_collective_failure(RuntimeError(text)), text
    # gloo's own timeout says "Timed out" with a capital T: the lower-case test missed it (issue 37, class D)
    assert is_collective_failure(RuntimeError(GLOO_RECV))
    for text in ("shape mismatch", "CUDA out of memory", "expected scalar type Float"):
        assert not is_collective_failure(RuntimeError(text))
    assert not is_collective_failure(ValueError(GLOO_RECV))  # not a collective's error type


def test_the_timeout_is_read_from_the_message():
    assert timed_out_after_s(GLOO_RECV) == 60.0
    assert timed_out_after_s(NCCL_WATCHDOG) == 600.0
    assert timed_out_after_s(GLOO_CLOSED) is None


def test_rank_lists_read_as_runs():
    assert rank_list([3, 0, 1, 2, 6, 9, 10]) == "0-3, 6, 9-10"
    assert rank_list([5]) == "5"


# ------------------------------------------------------------------ the collective, from the traceback
def _failed_collective():
    """A real traceback through torch.distributed (no process group: all_reduce raises inside it)."""
    import torch

    try:
        dist.all_reduce(torch.zeros(1))
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("all_reduce without a process group did not raise")


def test_the_collective_and_its_caller_are_read_from_the_traceback():
    e = _failed_collective()
    site = collective_faults.collective_of(e.__traceback__)
    assert site.startswith("all_reduce at tests/training/test_collective_faults.py:"), site
    assert site.endswith("(_failed_collective)")


def test_a_wait_on_an_asynchronous_collective_names_its_caller():
    assert collective_faults.describe_site(None, None, ("dcp_ext/runtime/params/exchange.py", 252, "wait")) == \
        "a wait on an asynchronous collective at dcp_ext/runtime/params/exchange.py:252 (wait)"
    assert collective_faults.describe_site("all_gather", [0, 1, 2], ("x.py", 3, "f")) == \
        "all_gather over ranks 0-2 at x.py:3 (f)"


# ------------------------------------------------------------------ the line
def _diagnosis(**kw):
    return liveness.Diagnosis(store="127.0.0.1:29500", **kw)


def test_a_stalled_rank_is_named_with_the_collective_and_the_timeout():
    e = RuntimeError(GLOO_RECV)
    line = fault_line(e, 1, _diagnosis(stopped=[liveness.Peer(1, "node-a", 4242, "stopped")]))
    assert line.startswith("rank 1 (pid 4242 on node-a) stopped answering: it is stopped (SIGSTOP"), line
    assert "timed out after 60 s (--distributed-timeout-minutes 1)" in line
    assert line.endswith("then rerun to resume from the last checkpoint")
    assert "\n" not in line


def test_several_stalled_ranks_are_named_by_runs_and_hosts():
    peers = [liveness.Peer(r, "node-b", 100 + r) for r in (4, 5, 6, 7)]
    line = fault_line(RuntimeError(GLOO_RECV), 10, _diagnosis(stopped=peers))
    assert line.startswith("ranks 4-7 (on node-b) stopped answering; "), line
    assert "see their logs and machines" in line


def test_a_dead_peer_is_lost_contact_naming_it():
    line = fault_line(RuntimeError(GLOO_CLOSED), 10, _diagnosis(stopped=[liveness.Peer(3, "node-a", 77, "gone")]))
    assert line.startswith("lost contact with rank 3 (pid 77 on node-a): it is gone (it died or was killed); "), line
    assert "Connection closed by peer" in line


def test_a_peer_that_left_saying_why_is_quoted():
    why = "its node's launcher (torchrun, pid 9 on node-b) is gone"
    line = fault_line(RuntimeError(GLOO_CLOSED), 10, _diagnosis(departed=[(liveness.Peer(1, "node-b", 11), why)]))
    assert line.startswith(f"lost contact with rank 1 (pid 11 on node-b), which stopped: {why}; "), line


def test_a_silent_store_and_no_culprit_are_said_as_such():
    line = fault_line(RuntimeError(GLOO_RECV), 1, liveness.Diagnosis(reachable=False, store="10.0.0.1:29500"))
    assert "cannot be told: the job's store at 10.0.0.1:29500 does not answer either" in line
    line = fault_line(RuntimeError(GLOO_RECV), 1, _diagnosis())
    assert "yet every rank still answers" in line and "deadlock" in line


def test_an_nccl_watchdog_timeout_names_the_operation():
    line = fault_line(RuntimeError(NCCL_WATCHDOG), 10, _diagnosis(stopped=[liveness.Peer(2, "g1", 5)]))
    assert "allreduce (NCCL)" in line and "timed out after 600 s (--distributed-timeout-minutes 10)" in line


# ------------------------------------------------------------------ heartbeats, read from a store
def _store(world, host="elsewhere"):
    store = dist.HashStore()
    for r in range(world):
        store.set(f"who/{r}", f"{host} {1000 + r}")
        store.add(f"beat/{r}", 1)
    return store


def _beating(store, ranks):
    """A sleep during which `ranks` beat (the others do not)."""
    def sleep(_seconds):
        for r in ranks:
            store.add(f"beat/{r}", 1)
    return sleep


def test_the_rank_whose_counter_stands_still_is_stopped():
    store = _store(4)
    d = liveness.diagnose_store(store, 0, 4, "here", 1.0, sleep=_beating(store, [0, 2, 3]))
    assert [p.rank for p in d.stopped] == [1] and d.departed == []
    assert d.stopped[0].host == "elsewhere" and d.stopped[0].pid == 1001


def test_a_rank_that_left_is_quoted_not_stopped_and_finished_is_neither():
    store = _store(3)
    store.set("left/1", "rank 1: NaN/inf iterations in a row")
    store.set("left/2", "finished")
    d = liveness.diagnose_store(store, 0, 3, "here", 1.0, sleep=_beating(store, [0]))
    assert d.stopped == []
    assert [(p.rank, why) for p, why in d.departed] == [(1, "rank 1: NaN/inf iterations in a row")]


def test_a_stopped_or_vanished_process_on_this_host_is_told_at_once():
    host = socket.gethostname()
    store = _store(3, host)
    store.set("who/1", f"{host} {_pid_that_does_not_exist()}")
    store.set("who/2", f"{host} {os.getpid()}")  # alive and running: needs the window

    def no_sleep(_s):
        raise AssertionError("waited although the stopped rank was known")

    d = liveness.diagnose_store(store, 0, 3, host, 1.0, sleep=no_sleep)
    assert [(p.rank, p.state) for p in d.stopped] == [(1, "gone")]


def _pid_that_does_not_exist() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_process_states_in_words():
    assert liveness.process_state(os.getpid()) == "running"
    assert liveness.process_state(_pid_that_does_not_exist()) == "gone"


def test_the_beat_interval_grows_past_a_thousand_ranks():
    assert liveness.interval_for(8) == 1.0 and liveness.interval_for(4000) == 4.0


def test_the_heartbeat_beats_and_notices_its_launcher_gone():
    store = dist.HashStore()
    beat = liveness.Heartbeat(store, 0, 2, 0.02, "here:0", launcher_pid=os.getppid())
    gone = threading.Event()
    beat._launcher_gone = gone.set  # the real one ends the process
    beat.start()
    time.sleep(0.2)
    assert int(store.add("beat/0", 0)) > 3 and not gone.is_set()
    beat.stop("finished")
    assert store.get("left/0") == b"finished"
    other = liveness.Heartbeat(dist.HashStore(), 0, 2, 0.02, "here:0", launcher_pid=os.getppid() + 12345)
    other._launcher_gone = gone.set
    other.start()
    assert gone.wait(5), "a parent that changed was not noticed"
    other.stop()


# ------------------------------------------------------------------ flags across ranks
def _args(**kw):
    base = dict(lr=1e-3, seq_length=128, dcp=False, save=None, loss_log=None, tensorboard_dir=None, wandb_project=None,
                dcp_log_plan=None, data_cache_path=None, yaml_cfg=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_per_node_flags_are_left_out_of_the_digest():
    a, b = _args(loss_log="/n0/loss.jsonl", data_cache_path="/n0/c"), _args(data_cache_path="/n1/c")
    assert job_agreement.this_rank(a)["digest"] == job_agreement.this_rank(b)["digest"]
    assert job_agreement.this_rank(_args(lr=2e-3))["digest"] != job_agreement.this_rank(a)["digest"]


def test_the_flag_that_differs_is_named_with_its_ranks():
    values = [job_agreement.compared_values(_args(lr=lr)) for lr in (1e-3, 1e-3, 2e-3, 2e-3)]
    line = job_agreement.disagreement_line(values, ["a", "a", "b", "b"])
    assert line == ("the ranks were given different flags (every node's launcher must pass the same ones): "
                    "--lr is 0.001 on ranks 0-1 (a) and 0.002 on ranks 2-3 (b)")
    values = [job_agreement.compared_values(_args(dcp=d, save=s)) for d, s in ((False, None), (True, "/ck"))]
    line = job_agreement.disagreement_line(values, ["a", "a"])
    assert "--dcp is not given on rank 0 and given on rank 1; also --save differ" in line


def test_an_output_of_one_rank_is_said_where_it_goes():
    gathered = [job_agreement.this_rank(_args(loss_log="/n0/loss.jsonl")) for _ in range(2)]
    gathered += [dict(job_agreement.this_rank(_args(loss_log="/n1/loss.jsonl")), host="n1") for _ in range(2)]
    for g in gathered[:2]:
        g["host"] = "n0"
    assert job_agreement.output_lines(gathered) == ["> --loss-log /n1/loss.jsonl is written by rank 3 (the last rank) on n1"]
    gathered[3] = dict(job_agreement.this_rank(_args()), host="n1")
    line, = job_agreement.output_lines(gathered)
    assert line.startswith("WARNING: --loss-log /n0/loss.jsonl (given to ranks 0-2) is written only by rank 3 "
                           "(the last rank, on n1), which was not given --loss-log: it will not be written"), line


def test_nothing_is_gathered_without_a_process_group():
    job_agreement.check(_args(), print, all_gather=lambda _: pytest.fail("gathered in a world of one"))

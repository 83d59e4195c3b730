"""Online recalibration in a real run: timings reduced to the same numbers on every rank,
the calibration checkpointed and continued on resume, `off` pinning the prices."""
import json
import os
import re

import pytest
import torch

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_plan_log, run_ranks

pytestmark = pytest.mark.dist


class _Replica:
    def __init__(self, n_mb, pp):
        self.micro_batches = [None] * n_mb
        self.pp = pp


class _Plan:
    replicas = [_Replica(2, 2), _Replica(3, 1), _Replica(1, 1)]


def _reduce_on_rank(rank, world):
    """Ranks 0,1: the two stages of replica 0; rank 2: replica 1; rank 3: replica 2."""
    from dcp_ext.runtime.schedule.timing import LocalTimings, reduce_step

    replica, stage, count = [(0, 0, 2), (0, 1, 2), (1, 0, 3), (2, 0, 1)][rank]
    local = LocalTimings(replica, stage, [0.1 * (rank + 1) * (j + 1) for j in range(count)], 0.01 * (rank + 1),
                         1.0 + rank)
    t = reduce_step(_Plan(), local, 2.0 + 0.1 * rank, torch.device("cpu"))
    return {"mb": t.micro_batches, "sync": t.sync_s, "replica": t.replica_s, "wall": t.wall_s}


def test_step_timings_are_the_same_on_every_rank_and_sum_the_stages():
    got = run_ranks(4, fn=_reduce_on_rank)
    assert all(g == got[0] for g in got)
    g = got[0]
    # replica 0: stage 0 (rank 0) + stage 1 (rank 1) per micro-batch
    assert g["mb"][0] == pytest.approx([0.1 * 1 + 0.1 * 2, 0.2 * 1 + 0.2 * 2])
    assert g["mb"][1] == pytest.approx([0.3, 0.6, 0.9])
    assert g["mb"][2] == pytest.approx([0.4])
    # the exchange's own time: the quickest rank's pull+push (the others waited for it to arrive)
    assert g["sync"] == pytest.approx([0.01, 0.01, 0.01])
    assert g["replica"] == [2.0, 3.0, 4.0]
    assert g["wall"] == pytest.approx(2.3)


def _flags(corpus, cache, iters, plans, *extra):
    return TINY_MODEL + ["--data-path", corpus, "--data-cache-path", cache, "--dcp", "--dcp-global-batch-tokens",
                         "512", "--global-batch-size", "4", "--train-iters", str(iters), "--dcp-log-plan", plans,
                         *extra]


def test_resume_continues_the_calibration_from_the_checkpoint(text_corpus, tmp_path):
    cache, save = str(tmp_path / "cache"), str(tmp_path / "ckpt")
    first, second = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")
    r = run_ranks(2, _flags(text_corpus, cache, 6, first, "--save", save, "--save-interval", "4"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "> cost model recalibrated online:" in r.stdout
    common = torch.load(os.path.join(save, "iter_0000004", "common.pt"), weights_only=False)
    cal = common["planner_state"]["calibration"]
    # iteration 4's plan was made from iterations 1-2 (3's timings queued behind it)
    assert cal["applied_through"] == 2 and [o["iteration"] for o in cal["pending"]] == [3]
    assert len(cal["micro_batches"]) >= 3 and len(cal["outside"]) == 3
    json.dumps(cal)  # plain data
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4")  # resume from iteration 4 (the run also saved at its end, 6)
    r = run_ranks(2, _flags(text_corpus, cache, 6, second, "--load", save))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_plan_log(first), read_plan_log(second)
    assert sorted(b) == [4, 5]
    # the first plan after the resume is the unbroken run's: same calibration, same prices
    assert b[4] == a[4]


def test_off_pins_the_prices(text_corpus, tmp_path):
    cache = str(tmp_path / "cache")
    runs = []
    for k in range(2):
        plans = str(tmp_path / f"plans{k}.jsonl")
        r = run_ranks(2, _flags(text_corpus, cache, 5, plans, "--dcp-recalibration", "off"))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "recalibrated online" not in r.stdout
        runs.append(read_plan_log(plans))
    assert runs[0] == runs[1]  # predicted times included: nothing measured moves them


def test_a_pool_chosen_again_creates_no_process_group(demo_cache, tmp_path, adaptive_demo):
    """The demo on 4 ranks with recalibration on: every reserve layout is measured before
    training (the startup calibration, which updates nothing: the first step's loss and
    gradient norm are the uncalibrated run's), the pool is chosen again from the measured
    prices (after the 2nd recalibration), and every process group was created before the
    first iteration on every rank (tests/support/group_count_entry.py counts from outside); the
    re-chosen pool's plans run on groups that exist (an unregistered type has none)."""
    from tests.conftest import demo_flags
    from tests.support.helpers import REPO, read_loss_log

    log, plans, groups = str(tmp_path / "loss.jsonl"), str(tmp_path / "plans.jsonl"), str(tmp_path / "groups")
    r = run_ranks(4, demo_flags(demo_cache, "adaptive", 5, log, plans) + ["--dcp-recalibration", "on"],
                  env={"DCP_GROUP_LOG": groups}, entry=os.path.join(REPO, "tests", "support", "group_count_entry.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "candidate pool chosen again from the measured prices" in r.stdout, r.stdout[-3000:]
    probed = re.search(r"> dcp: measured (\d+) layouts on the first global batch before training", r.stdout)
    assert probed and int(probed.group(1)) >= 4, r.stdout[-3000:]
    assert "> planner over the last 5 iterations: measured" in r.stdout
    assert "memory beyond the model at rest" in r.stdout
    assert sorted(read_plan_log(plans)) == [0, 1, 2, 3, 4]
    # the loss log splits the exposed wait: each replica's measured forward+backward beside
    # its predicted time, one per replica of that iteration's plan
    with open(plans) as f:
        by_index = {p["index"]: p for p in map(json.loads, f)}
    records = read_loss_log(log)
    assert len(records) == 5
    first, reference = records[0], adaptive_demo.losses[0]
    assert first["lm loss"] == pytest.approx(reference["lm loss"], rel=1e-5)
    assert first["grad norm"] == pytest.approx(reference["grad norm"], rel=1e-4)
    for rec in records:
        plan = by_index[rec["iteration"] - 1]
        assert rec["replica_predicted_s"] == [round(r["predicted_time_s"], 6) for r in plan["replicas"]]
        assert len(rec["replica_compute_s"]) == len(plan["replicas"])
        # summed over a pipeline's stages: each stage was busy at most the iteration's time
        assert all(0.0 < c / r["pp"] <= rec["elapsed_s"] for c, r in zip(rec["replica_compute_s"], plan["replicas"])), rec
    created = {rank: read_loss_log(f"{groups}.{rank}") for rank in range(4)}
    assert all(created.values()) and len({len(c) for c in created.values()}) == 1
    assert not any(c["iterations_done"] > 0 for cs in created.values() for c in cs)
    # each rank ran on its own share of the cores (CPU runs bind their ranks at start)
    from megatron.training.startup.cpu_binding import cores_for

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) > 1:
        for rank, calls in created.items():
            assert {tuple(c["cores"]) for c in calls} == {tuple(cores_for(rank, 4, allowed))}, (rank, calls[0])

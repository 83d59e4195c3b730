"""The adaptive runtime end to end through pretrain_gpt_dcp.py (issue 5, acceptance 3).

The CPU demo with --dcp --dcp-planner adaptive switches layouts and its losses equal those
of --dcp-planner static (same seed, same data) at each of the first 20 iterations; a run
resumed from an adaptive checkpoint continues exactly (same world size) or within float
rounding (another world size).
"""
import json
import os

import pytest

from tests.helpers import launch, read_loss_log

pytestmark = pytest.mark.dist

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cpu_demo.yaml")


def demo_flags(cache, planner, iters, log, plan_log=None):
    flags = ["--yaml-cfg", DEMO, "--dcp", "--dcp-planner", planner, "--data-cache-path", cache,
             "--dcp-global-batch-tokens", "4096", "--train-iters", str(iters), "--lr-decay-iters", "60",
             "--log-interval", "1", "--eval-iters", "0", "--loss-log", log]
    return flags + (["--dcp-log-plan", plan_log] if plan_log else [])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp_cache"))


def test_adaptive_switches_layouts_and_matches_static(cache, tmp_path):
    runs = {}
    for planner in ("adaptive", "static"):
        log, plans = str(tmp_path / f"{planner}.jsonl"), str(tmp_path / f"{planner}.plans")
        r = launch(demo_flags(cache, planner, 20, log, plans), nproc=4)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(plans) as f:
            layouts = [tuple(sorted((x["tp"], x["cp"], x["pp"]) for x in json.loads(line)["replicas"])) for line in f]
        runs[planner] = (read_loss_log(log), layouts)
    adaptive, static = runs["adaptive"][0], runs["static"][0]
    assert len(adaptive) == len(static) == 20
    for a, s in zip(adaptive, static):
        assert a["lm loss"] == pytest.approx(s["lm loss"], rel=1e-4), (a, s)
    assert len(set(runs["adaptive"][1])) >= 2, "the adaptive planner never changed layout"
    assert adaptive[-1]["lm loss"] < adaptive[0]["lm loss"] - 0.5  # it learns


def test_adaptive_checkpoint_resumes_exactly_and_on_another_world_size(cache, tmp_path):
    full = str(tmp_path / "full.jsonl")
    r = launch(demo_flags(cache, "adaptive", 6, full), nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    save = str(tmp_path / "ckpt")
    r = launch(demo_flags(cache, "adaptive", 6, str(tmp_path / "first.jsonl")) +
               ["--save", save, "--save-interval", "3", "--exit-interval", "3"], nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = read_loss_log(full)[3:]
    for nproc in (4, 2):
        log = str(tmp_path / f"resume{nproc}.jsonl")
        r = launch(demo_flags(cache, "adaptive", 6, log) + ["--load", save], nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        resumed = read_loss_log(log)
        assert [x["iteration"] for x in resumed] == [4, 5, 6]
        for got, want in zip(resumed, reference):
            if nproc == 4:
                assert got["lm loss"] == want["lm loss"], (got, want)
            else:
                assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5)

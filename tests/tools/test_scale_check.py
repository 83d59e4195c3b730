"""scripts/scale_check.py --small: the engine built on the meta device under torch's `fake`
process groups holds what the cost model charges (within 5%), and its verdict adds up.

One subprocess (the fake process group must not leak into the test process), two checks:
the adaptive planner's own pool, and a fixed pool with TP and PP stages (rank 6 = the last
stage of the tp2·pp2 replica)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("parameters", "main_grads", "master", "grad_shard", "adam", "exchange")

SNIPPET = """
import sys
sys.path.insert(0, {scripts!r})
import scale_check
a = scale_check.main(["--small", "--json", {pool!r}])
b = scale_check.main(["--small", "--layouts", "1xtp2cp1pp2+1xtp4cp1pp1", "--rank", "6", "--json", {fixed!r}])
sys.exit(a or b)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    pool, fixed = str(d / "pool.json"), str(d / "fixed.json")
    code = SNIPPET.format(scripts=os.path.join(REPO, "scripts"), pool=pool, fixed=fixed)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(pool) as f, open(fixed) as g:
        return proc, json.load(f)[0], json.load(g)[0]


def _consistent(r):
    for key in ("model", "rank", "replica_types", "engine_bytes", "engine_total_bytes", "cost_model_total_bytes",
                "rel_diff", "activation_bytes", "need_bytes", "capacity_bytes", "verdict"):
        assert key in r, key
    assert r["model"] == "small" and r["world"] == 8 and 0 <= r["rank"] < 8
    assert set(KINDS) <= set(r["engine_bytes"])
    assert r["engine_total_bytes"] == pytest.approx(sum(r["engine_bytes"].values()))
    # the engine holds what the cost model charges
    assert abs(r["engine_total_bytes"] - r["cost_model_total_bytes"]) <= 0.05 * r["cost_model_total_bytes"]
    assert r["rel_diff"] == pytest.approx((r["engine_total_bytes"] - r["cost_model_total_bytes"])
                                          / r["cost_model_total_bytes"])
    for kind in KINDS:  # kind by kind, too
        assert r["engine_bytes"][kind] == pytest.approx(r["cost_model_bytes"][kind], rel=0.05), kind
    # verdict: engine state + the planned activation peak against the planning capacity
    assert r["activation_bytes"] > 0 and r["capacity_bytes"] > 0
    c = r["communicators"]
    assert r["need_bytes"] == pytest.approx(r["engine_total_bytes"] + c["charged_bytes"] + r["activation_bytes"])
    # the planner's count of this rank's communicators is the groups the engine created for it
    assert c["rank"] == c["engine_rank"] > 0 and c["rank"] <= c["most"] == c["charged"]
    assert c["charged_bytes"] == max(0, c["charged"] - c["reserved"]) * c["bytes_each"]
    assert r["verdict"] == ("OK" if r["need_bytes"] <= r["capacity_bytes"] else "OVER")
    assert r["planned"] and all(p["activation_bytes"] <= r["activation_bytes"] for p in r["planned"])


def test_planner_pool_worst_rank(run):
    proc, r, _ = run
    _consistent(r)
    # the default run registers the reserve a re-chosen pool may use: more layouts than the pool's
    pool_layouts = {part.split("x", 1)[1] for entry in r["pool"].split(": ", 2)[-1].split("; ") for part in entry.split("+")}
    assert len(r["layouts"]) > len(pool_layouts)
    assert r["verdict"] == "OK"
    # the default rank plays the pool's largest stage: its buffer is the cost model's
    assert r["engine_params"]["buffer"] == pytest.approx(r["cost_model_params"]["buffer"])
    table = proc.stdout
    assert "| model" in table and "verdict" in table and "| small" in table


def test_fixed_pool_pipeline_stage(run):
    _, _, r = run
    _consistent(r)
    assert r["rank"] == 6 and r["replica_types"] == ["tp2cp1pp2[s1]"]
    # the last stage of tp2·pp2 is a little smaller than the pool's largest stage (tp4), which
    # the cost model charges every layout of the pool
    assert r["engine_params"]["buffer"] <= r["cost_model_params"]["buffer"]

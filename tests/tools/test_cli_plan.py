"""dcp-plan and dcp-simulate end to end on a small length file (CPU demo model)."""
import json

import numpy as np

from dcp_ext.planning.batching import global_batches
from dcp_ext.cli import plan as plan_cli
from dcp_ext.cli import simulate as sim_cli
from dcp_ext.planning.plan import Plan, validate_iteration


def _lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lens = np.minimum(rng.lognormal(6.5, 1.2, 400).astype(int) + 1, 5000)
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(str(x) for x in lens) + "\n")
    return p, lens


def test_dcp_plan_writes_a_valid_plan(tmp_path, capsys):
    path, lens = _lengths_file(tmp_path)
    out = tmp_path / "plan.json"
    rc = plan_cli.main(["--lengths", str(path), "--model", "demo", "--cluster", "cpu-gloo x4",
                        "--global-batch-tokens", "8192", "--max-seq-len", "2048", "--iterations", "5",
                        "--planner", "adaptive", "--out", str(out), "--quiet"])
    assert rc == 0
    plan = Plan.load(str(out))
    assert plan.cluster["name"] == "cpu-gloox4" and plan.model["name"] == "demo"
    want = global_batches(lens.tolist(), 8192, 2048, count=5)
    assert [it.sample_ids for it in plan.iterations] == want  # sample ids are line numbers
    for it in plan.iterations:
        validate_iteration(it, 4, 4, 8, 4)
    assert "wrote 5 iterations" in capsys.readouterr().out


def test_dcp_simulate_table_json_and_timeline(tmp_path, capsys):
    path, _ = _lengths_file(tmp_path)
    js, png = tmp_path / "r.json", tmp_path / "t.png"
    rc = sim_cli.main(["--lengths", str(path), "--model", "demo", "--cluster", "cpu-gloox4",
                       "--global-batch-tokens", "8192", "--max-seq-len", "2048", "--iterations", "4",
                       "--json", str(js), "--timeline", str(png), "--quiet"])
    assert rc == 0
    table = capsys.readouterr().out
    for name in ("adaptive", "static", "dynamic-cp", "cp-buckets", "hydraulis"):
        assert name in table
    res = json.loads(js.read_text())
    assert res["iterations"] == 4
    for r in res["planners"].values():
        assert r["valid"] and r["gap_to_bound"] >= -1e-9
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_input_to_the_tools_is_one_line(tmp_path, capsys):
    path, _ = _lengths_file(tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_text("10\n20\nthirty\n")
    base = ["--lengths", str(path), "--model", "demo", "--cluster", "cpu-gloox4", "--global-batch-tokens", "8192",
            "--max-seq-len", "2048", "--iterations", "2", "--quiet"]
    for tool, extra, code, needle in (
        (plan_cli, ["--out", str(tmp_path / "p.json"), "--iterations", "0"], 2, "--iterations 0 must be >= 1"),
        (plan_cli, ["--out", str(tmp_path / "p.json"), "--lengths", str(bad)], 1, "bad.txt:3: 'thirty' is not an integer"),
        (plan_cli, ["--out", str(tmp_path / "p.json"), "--model", "nope"], 2, "--model: model preset 'nope'"),
        (sim_cli, ["--max-seq-len", "9000"], 2, "--max-seq-len 9000 exceeds --global-batch-tokens 8192"),
        (sim_cli, ["--cluster", "x"], 2, "--cluster: cluster preset 'x'"),
    ):
        assert tool.main(base + extra) == code
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err

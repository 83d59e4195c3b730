"""scripts/gpu_check.sh --dry-run: the GPU check's phases on the CPU at tiny sizes, one summary
JSON with every phase passed or skipped with a reason, and the numbers each phase reports.

The GPU machine runs the same script without --dry-run (it has no network: the wheels it
lacks travel with the tree, scripts/fetch_gpu_wheels.sh). Here it must keep working, so CI
runs the dry run; the unit tests below hold the pieces a CPU cannot exercise end to end
(the sync-warning capture, the loss comparison).
"""
import json
import os
import subprocess
import sys
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_check  # noqa: E402


@pytest.mark.dist
@pytest.mark.slow  # about a minute on 2 cores: eight tiny training runs for (a), two for (c)
def test_dry_run_writes_every_phase_with_its_numbers(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--dry-run",
                        "--work", str(tmp_path / "work")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    path = out / gpu_check.SUMMARY_NAME
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert str(path) in r.stdout  # the summary's path is printed
    summary = json.loads(path.read_text())
    assert summary["schema"] == gpu_check.SCHEMA and summary["mode"] == "dry-run" and summary["passed"] is True
    assert set(summary["phases"]) == set(gpu_check.PHASES)
    for name, phase in summary["phases"].items():
        assert phase["status"] in ("passed", "skipped"), (name, phase.get("reason"))
        if phase["status"] == "skipped":
            assert phase["reason"], name
        assert phase["elapsed_s"] >= 0 and phase["budget_s"] > 0, name
    assert (out / gpu_check.LOG_NAME).stat().st_size > 0

    env_info = summary["environment"]
    assert env_info["cuda_available"] is False and env_info["megatron_core"]

    a = summary["phases"]["a_equivalence"]
    assert a["status"] == "passed"
    assert set(a["tolerances"]) == {"fp32", "bf16"}
    assert set(a["runs"]) == {"static fp32", "static bf16", "dcp fp32", "dcp bf16"}
    for key, row in a["runs"].items():
        tol = a["tolerances"][key.split()[1]]
        assert row["passed"] and row["iterations_compared"] == a["iterations"], key
        assert row["max_rel_diff"] <= tol["max_rel"], key
        assert len(row["device_losses"]) == len(row["cpu_losses"]) == a["iterations"], key

    b = summary["phases"]["b_device_and_syncs"]
    assert b["status"] == "skipped" and "CUDA" in b["reason"]
    assert set(b["runs"]) == set(a["runs"])
    for key, row in b["runs"].items():
        assert row["steps_wrapped"] == a["iterations"] and row["path"] == key.split()[0], key
        assert row["tensors_by_device"]["cpu"]["parameters"] > 0, key
        assert row["cpu_offenders"] == [], key  # on a CPU run the CPU is the device

    c = summary["phases"]["c_speed"]
    assert c["status"] == "passed"
    for run in (c["static"], c["dcp_static_planner"]):
        assert run["rc"] == 0 and run["iterations"] == c["iterations"]
        assert run["steady_tokens_per_s"] > 0 and run["wall_tokens_per_s"] > 0 and run["wall_s"] > 0
    assert c["ratio_dcp_over_static_steady"] > 0 and c["ratio_dcp_over_static_wall"] > 0
    assert c["differs"] and c["model"]["parameters"] > 0

    for name in ("d_memory", "e_gpu_tests"):
        assert summary["phases"][name]["status"] == "skipped" and "CUDA" in summary["phases"][name]["reason"]


def test_sync_warnings_are_counted_per_step_and_call_site():
    import gpu_check_entry

    with warnings.catch_warnings():
        recorder = gpu_check_entry.SyncRecorder()
        passed_on = []
        recorder.original_showwarning = lambda message, *rest: passed_on.append(str(message))
        recorder.install()

        def sync_here():  # what torch raises at a synchronising CUDA call under "warn"
            warnings.warn(gpu_check_entry.SYNC_MESSAGE + " (Triggered internally at CUDAFunctions.cpp:1)")

        sync_here()  # setup: not counted
        recorder.set_bucket("step 1")
        sync_here()
        sync_here()
        warnings.warn("another warning, passed on")
        recorder.set_bucket("after step 1")
        sync_here()
        recorder.set_bucket("step 2")
        sync_here()
        recorder.set_bucket(None)
    assert passed_on == ["another warning, passed on"]  # other warnings go where they went
    summary = recorder.summary()
    assert [(s["step"], s["in_step"], s["after_step"]) for s in summary["steps"]] == [(1, 2, 1), (2, 1, 0)]
    (site,) = summary["by_site"]
    assert site.startswith("tests/tools/test_gpu_check_dry_run.py:") and "(sync_here)" in site
    assert summary["by_site"][site] == 4


def test_explicit_device_syncs_are_counted_while_the_mode_is_on():
    """torch.cuda.synchronize() and Event.synchronize() do not warn under the sync debug mode:
    the entry wraps them (here on a stand-in for torch.cuda)."""
    import types

    import gpu_check_entry

    class Event:
        def synchronize(self):
            return "waited"

    mode = {"now": 0}
    cuda = types.SimpleNamespace(synchronize=lambda device=None: "synced", Event=Event,
                                 get_sync_debug_mode=lambda: mode["now"])
    with warnings.catch_warnings():
        recorder = gpu_check_entry.SyncRecorder()
        recorder.count_explicit_syncs(types.SimpleNamespace(cuda=cuda))
    recorder.set_bucket("step 1")
    assert cuda.synchronize() == "synced"  # mode off: not counted
    mode["now"] = 1
    assert cuda.synchronize() == "synced" and Event().synchronize() == "waited"
    sites = recorder.summary()["steps"][0]["sites"]
    assert sorted(site.rsplit(" [", 1)[1] for site in sites) == ["Event.synchronize]", "torch.cuda.synchronize]"]


def test_losses_are_compared_per_iteration_within_the_tolerance():
    tol = gpu_check.TOLERANCES["fp32"]
    cpu = [{"iteration": i, "lm loss": 5.0 - 0.1 * i} for i in range(1, 5)]
    near = [{"iteration": r["iteration"], "lm loss": r["lm loss"] * (1 + 1e-5)} for r in cpu]
    far = [dict(r, **{"lm loss": r["lm loss"] * 1.01}) for r in cpu]
    assert gpu_check.compare_losses(near, cpu, 4, tol)["passed"]
    assert not gpu_check.compare_losses(far, cpu, 4, tol)["passed"]
    short = gpu_check.compare_losses(near[:3], cpu, 4, tol)
    assert not short["passed"] and short["problems"]
    nan = gpu_check.compare_losses(near[:3] + [{"iteration": 4, "lm loss": float("nan")}], cpu, 4, tol)
    assert not nan["passed"]

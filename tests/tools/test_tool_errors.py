"""The console tools' one error boundary: every row is a bad argument, input file or output
path given to a tool, and must end in exactly one `error:` line on stderr (after the tool's
name for preprocess_data.py and dataset_stats.py, as they always said it), the exit code of
its kind (2: a bad argument, 1: a file or the OS, 130: Ctrl-C) and no traceback.

Tools run in this process where they start no process (their `main(argv)`, stderr read with
capsys), which keeps those rows in the unit tier. Rows that need a read-only directory, a
read-only file system or a full disk use `outputs` (chattr/mount: processes, so `dist`) and
are skipped with the reason where this machine cannot make them (not root). A few rows run
the real scripts as their own process (`tests.support.helpers.run_tool`) to cover the entry points.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import pytest

from tests.support.helpers import read_only_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = ["--yaml-cfg", os.path.join(REPO, "examples", "cpu_demo.yaml")]
HUGE = "99999999999999999999999"


# ------------------------------------------------------------------ the tools, in-process
def _main(tool: str):
    if tool == "plan":
        from dcp_ext.cli.plan import main
    elif tool == "simulate":
        from dcp_ext.cli.simulate import main
    elif tool == "stats":
        from dcp_ext.data.stats_report import main
    elif tool == "preprocess":
        from dcp_ext.data.preprocess import main
    else:
        from megatron.training.adaptive.profiling import main
    return main


PREFIX = {"stats": "dataset_stats.py: ", "preprocess": "preprocess_data.py: "}


def call(tool: str, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """The tool's main as the interpreter would run it: its exit code, and what an escaping
    exception would print (a traceback) or a SystemExit's message."""
    capsys.readouterr()
    try:
        code = _main(tool)(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter's own report of a Ctrl-C nobody handled
        traceback.print_exc()
        code = 130
    except Exception:  # noqa: BLE001 - what a console script would show
        traceback.print_exc()
        code = 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def assert_one_line(result, code: int, needle: str, prefix: str = "") -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(prefix + "error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert result.returncode == code, (result.returncode, lines[0])
    return lines[0]


# ------------------------------------------------------------------ inputs and outputs
def _model_json(**changes):
    from dcp_ext.planning.specs import ModelSpec

    return dict(ModelSpec.from_preset("demo").to_json(), **changes)


def _cluster_json(gpu=None, **changes):
    from dcp_ext.planning.specs import ClusterSpec

    d = dict(ClusterSpec.from_preset("cpu-gloox4").to_json(), **changes)
    d["gpu"] = dict(d["gpu"], **(gpu or {}))
    return d


def _write_inputs(d: str) -> None:
    with open(os.path.join(d, "good.txt"), "w") as f:
        f.write("\n".join(str(100 + 7 * i) for i in range(300)) + "\n")
    with open(os.path.join(d, "huge.txt"), "w") as f:
        f.write("500\n" * 50 + HUGE + "\n")
    with open(os.path.join(d, "in.jsonl"), "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document {i} " * 30}) + "\n")
    with open(os.path.join(d, "big.jsonl"), "w") as f:  # ~300 KiB of tokens (2 bytes each)
        for i in range(100):
            f.write(json.dumps({"text": "x" * 1500}) + "\n")
    with open(os.path.join(d, "afile"), "w") as f:
        f.write("not a folder\n")
    files = {
        "notjson.json": "not json {",
        "m_list.json": [1, 2],
        "m_str.json": _model_json(num_layers="four"),
        "m_zero.json": _model_json(hidden_size=0),
        "m_float.json": _model_json(num_layers=3.5),
        "m_missing.json": {"foo": 1},
        "m_unknown.json": _model_json(swigl=False),
        "m_heads.json": _model_json(num_attention_heads=3),
        "m_bool.json": _model_json(swiglu="yes"),
        "c_zero.json": _cluster_json(num_gpus=0),
        "c_neg.json": _cluster_json(num_gpus=-2),
        "c_gpn0.json": _cluster_json(gpus_per_node=0),
        "c_str.json": _cluster_json(num_gpus="four"),
        "c_float.json": _cluster_json(num_gpus=2.5),
        "c_bool.json": _cluster_json(num_gpus=True),
        "c_preset_zero.json": {"name": "cpu-gloox4", "num_gpus": 0},
        "c_preset_other.json": {"name": "cpu-gloox4", "num_gpus": 8},
        "c_gpu_str.json": _cluster_json(gpu={"peak_flops": "fast"}),
        "c_gpu_missing.json": {"name": "x", "num_gpus": 4, "gpus_per_node": 4, "gpu": {"name": "g"}},
    }
    for name, content in files.items():
        with open(os.path.join(d, name), "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tool_inputs"))
    _write_inputs(d)
    return d


def make_outputs(root: str, on_teardown) -> dict:
    """{what: why it cannot be made here} for `ro` (a directory this process cannot write:
    mode 555, or the immutable attribute for root), `rofs` (a read-only file system), `full`
    (a full 64 KiB tmpfs) and `small` (a 128 KiB tmpfs, empty: fills during a larger write)."""
    unavailable = {}
    read_only_dir(root, on_teardown, unavailable)
    for name, options in (("rofs", "ro,size=64k"), ("full", "size=64k"), ("small", "size=128k")):
        path = os.path.join(root, name)
        os.makedirs(path)
        mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                                                       capture_output=True).returncode == 0
        if not mounted:
            unavailable[name] = f"needs root to mount a tmpfs ({options})"
            continue
        on_teardown(lambda p=path: subprocess.run(["umount", "-l", p], capture_output=True))
    if "full" not in unavailable:
        try:
            with open(os.path.join(root, "full", "filler"), "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass
    return unavailable


@pytest.fixture
def outputs(tmp_path_factory, request):
    """Per test (a few ms of mount/chattr): its teardown starts processes, so it must run in
    the teardown of the dist test that used it, never in a unit test's that happens to be last."""
    root = str(tmp_path_factory.mktemp("tool_outputs"))
    return root, make_outputs(root, request.addfinalizer)


# ------------------------------------------------------------------ the rows
@dataclass
class Row:
    id: str
    tool: str  # plan, simulate, stats, preprocess, profile
    argv: list  # {d}: inputs, {o}: outputs
    code: int
    needle: str
    needs: tuple = ()  # outputs this row writes into (ro, rofs, full, small): a dist row
    left: str | None = None  # a folder the failed run must leave empty (no partial output)


LENS = ["--model", "demo", "--cluster", "cpu-gloox4", "--global-batch-tokens", "8192", "--max-seq-len", "2048",
        "--iterations", "2", "--quiet"]


def plan(*extra, lengths="{d}/good.txt", out="{d}/plan.json"):
    """dcp-plan argv; a later flag overrides an earlier one."""
    return ["--lengths", lengths] + LENS + ["--out", out] + list(extra)


def sim(*extra, lengths="{d}/good.txt"):
    return ["--lengths", lengths] + LENS + ["--planners", "static"] + list(extra)


def stats(*extra):
    return ["--lengths-file", "{d}/good.txt", "--seq-length", "1024", "--png", "{d}/h.png"] + list(extra)


def prep(*extra, out="{d}/prep/x", src="{d}/in.jsonl"):
    return ["--input", src, "--tokenizer-type", "ByteLevelTokenizer", "--no-progress",
            "--output-prefix", out] + list(extra)


def prof(*extra):
    return DEMO + ["--nproc", "2", "--layouts", "tp1cp1pp1", "--quiet", "--out", "{d}/prof/p.json"] + list(extra)


_PERM = "permission denied"
_ROFS = "read-only file system"
_FULL = "no space left on the device"

ROWS = [
    # lengths files: a value no document can have (today: OverflowError deep in numpy)
    Row("plan-huge-length", "plan", plan(lengths="{d}/huge.txt"), 1, f"huge.txt:51: length {HUGE} is too large"),
    Row("simulate-huge-length", "simulate", sim(lengths="{d}/huge.txt"), 1, f"huge.txt:51: length {HUGE} is too large"),
    Row("stats-huge-length", "stats", stats("--lengths-file", "{d}/huge.txt"), 1,
        f"huge.txt:51: length {HUGE} is too large"),
    # --model JSON files
    Row("model-not-json", "plan", plan("--model", "{d}/notjson.json"), 1,
        "notjson.json: not a ModelSpec JSON file: not valid JSON"),
    Row("model-not-an-object", "plan", plan("--model", "{d}/m_list.json"), 1, "m_list.json: expected a JSON object"),
    Row("model-field-string", "plan", plan("--model", "{d}/m_str.json"), 1,
        "num_layers must be a positive integer (got 'four')"),
    Row("model-field-zero", "plan", plan("--model", "{d}/m_zero.json"), 1,
        "hidden_size must be a positive integer (got 0)"),
    Row("model-field-float", "simulate", sim("--model", "{d}/m_float.json"), 1,
        "num_layers must be a positive integer (got 3.5)"),
    Row("model-missing-fields", "plan", plan("--model", "{d}/m_missing.json"), 1, "missing fields name, num_layers"),
    Row("model-unknown-field", "plan", plan("--model", "{d}/m_unknown.json"), 1, "unknown field 'swigl'"),
    Row("model-heads-not-grouped", "plan", plan("--model", "{d}/m_heads.json"), 1,
        "num_attention_heads 3 is not a multiple of num_query_groups 4"),
    Row("model-bool-field", "plan", plan("--model", "{d}/m_bool.json"), 1, "swiglu must be true or false (got 'yes')"),
    # --cluster JSON files (num_gpus 0 was blamed on the layout)
    Row("cluster-num-gpus-zero", "plan", plan("--cluster", "{d}/c_zero.json"), 1,
        "num_gpus must be a positive integer (got 0)"),
    Row("cluster-num-gpus-zero-simulate", "simulate", sim("--cluster", "{d}/c_zero.json"), 1,
        "num_gpus must be a positive integer (got 0)"),
    Row("cluster-num-gpus-negative", "plan", plan("--cluster", "{d}/c_neg.json"), 1,
        "num_gpus must be a positive integer (got -2)"),
    Row("cluster-gpus-per-node-zero", "plan", plan("--cluster", "{d}/c_gpn0.json"), 1,
        "gpus_per_node must be a positive integer (got 0)"),
    Row("cluster-num-gpus-string", "plan", plan("--cluster", "{d}/c_str.json"), 1,
        "num_gpus must be a positive integer (got 'four')"),
    Row("cluster-num-gpus-float", "plan", plan("--cluster", "{d}/c_float.json"), 1,
        "num_gpus must be a positive integer (got 2.5)"),
    Row("cluster-num-gpus-bool", "plan", plan("--cluster", "{d}/c_bool.json"), 1,
        "num_gpus must be a positive integer (got true)"),
    Row("cluster-preset-name-num-gpus-zero", "plan", plan("--cluster", "{d}/c_preset_zero.json"), 1,
        "num_gpus must be a positive integer (got 0)"),
    Row("cluster-preset-name-other-num-gpus", "plan", plan("--cluster", "{d}/c_preset_other.json"), 1,
        "num_gpus 8 disagrees with preset 'cpu-gloox4' (4)"),
    Row("cluster-gpu-field-string", "plan", plan("--cluster", "{d}/c_gpu_str.json"), 1,
        "gpu.peak_flops must be a positive number (got 'fast')"),
    Row("cluster-gpu-missing-fields", "plan", plan("--cluster", "{d}/c_gpu_missing.json"), 1,
        "gpu: missing fields peak_flops"),
    # outputs of dcp-plan / dcp-simulate: found before any planning
    Row("plan-out-missing-folder", "plan", plan(out="{d}/nope/plan.json"), 1, "nope does not exist: create it"),
    Row("plan-out-under-a-file", "plan", plan(out="{d}/afile/plan.json"), 1, "afile is a file, not a folder"),
    Row("plan-out-is-a-dir", "plan", plan(out="{d}"), 1, "is a directory, not a file"),
    Row("plan-out-read-only", "plan", plan(out="{o}/ro/plan.json"), 1, _PERM, needs=("ro",)),
    Row("plan-out-full-disk", "plan", plan(out="{o}/full/plan.json"), 1, _FULL, needs=("full",)),
    Row("simulate-json-read-only", "simulate", sim("--json", "{o}/ro/r.json"), 1, _PERM, needs=("ro",)),
    Row("simulate-timeline-read-only-fs", "simulate", sim("--timeline", "{o}/rofs/t.png"), 1, _ROFS,
        needs=("rofs",)),
    Row("simulate-json-missing-folder", "simulate", sim("--json", "{d}/nope/r.json"), 1, "nope does not exist"),
    # dcp-dataset-stats
    Row("stats-bad-int", "stats", stats("--seq-length", "abc"), 2, "--seq-length: invalid int value: 'abc'"),
    Row("stats-no-source", "stats", ["--seq-length", "8"], 2, "one of the arguments"),
    Row("stats-png-is-a-dir", "stats", stats("--png", "{d}"), 1, "is a directory, not a file"),
    Row("stats-png-missing-folder", "stats", stats("--png", "{d}/nope/h.png"), 1, "nope does not exist"),
    Row("stats-png-read-only", "stats", stats("--png", "{o}/ro/h.png"), 1, _PERM, needs=("ro",)),
    Row("stats-png-read-only-fs", "stats", stats("--png", "{o}/rofs/h.png"), 1, _ROFS, needs=("rofs",)),
    Row("stats-png-full-disk", "stats", stats("--png", "{o}/full/h.png"), 1, _FULL, needs=("full",)),
    Row("stats-json-read-only", "stats", stats("--json", "{o}/ro/h.json"), 1, _PERM, needs=("ro",)),
    # tools/preprocess_data.py
    Row("preprocess-bad-int", "preprocess", prep("--workers", "abc"), 2, "--workers: invalid int value: 'abc'"),
    Row("preprocess-no-input", "preprocess", ["--tokenizer-type", "ByteLevelTokenizer", "--output-prefix", "x"], 2,
        "the following arguments are required: --input"),
    Row("preprocess-out-under-a-file", "preprocess", prep(out="{d}/afile/x"), 1, "afile is a file, not a folder"),
    Row("preprocess-out-read-only", "preprocess", prep(out="{o}/ro/x"), 1, _PERM, needs=("ro",), left="{o}/ro"),
    Row("preprocess-out-read-only-fs", "preprocess", prep(out="{o}/rofs/x"), 1, _ROFS, needs=("rofs",),
        left="{o}/rofs"),
    Row("preprocess-out-full-disk", "preprocess", prep(out="{o}/full/x"), 1, _FULL, needs=("full",)),
    Row("preprocess-out-fills-during-the-write", "preprocess", prep(out="{o}/small/x", src="{d}/big.jsonl"), 1,
        _FULL + " (writing ", needs=("small",), left="{o}/small"),
    # dcp-profile: its own flags, Megatron's (ArgumentError), the layouts, --out; all before any rank starts
    Row("profile-layout-unreadable", "profile", prof("--layouts", "tp2xcp2"), 2, "--layouts: cannot read 'tp2xcp2'"),
    Row("profile-layout-invalid", "profile", prof("--layouts", "tp3"), 2, "tp3cp1pp1 is not valid for this model"),
    Row("profile-megatron-range", "profile", prof("--num-layers", "-1"), 2, "--num-layers -1 must be >= 1"),
    Row("profile-megatron-type", "profile", prof("--hidden-size", "abc"), 2, "--hidden-size: invalid int value"),
    Row("profile-megatron-unknown", "profile", prof("--bogus-flag", "3"), 2, "unknown flag --bogus-flag"),
    Row("profile-own-type", "profile", prof("--points", "abc"), 2, "--points: invalid int value: 'abc'"),
    Row("profile-nproc-zero", "profile", prof("--nproc", "0"), 2, "--nproc 0 must be >= 1"),
    Row("profile-points-zero", "profile", prof("--points", "0"), 2, "--points 0 must be >= 1"),
    Row("profile-repeats-zero", "profile", prof("--repeats", "0"), 2, "--repeats 0 must be >= 1"),
    Row("profile-warmup-negative", "profile", prof("--warmup", "-1"), 2, "--warmup -1 must be >= 0"),
    Row("profile-threads-zero", "profile", prof("--threads", "0"), 2, "--threads 0 must be >= 1"),
    Row("profile-min-seq-len-zero", "profile", prof("--min-seq-len", "0"), 2, "--min-seq-len 0 must be >= 1"),
    Row("profile-max-below-min", "profile", prof("--max-seq-len", "16"), 2,
        "--max-seq-len 16 is below --min-seq-len 32"),
    Row("profile-docs-per-pack-text", "profile", prof("--docs-per-pack", "1,a"), 2,
        "--docs-per-pack '1,a': expected positive integers"),
    Row("profile-docs-per-pack-zero", "profile", prof("--docs-per-pack", "0"), 2,
        "--docs-per-pack '0': expected positive integers"),
    Row("profile-recompute", "profile", prof("--recompute", "half"), 2, "--recompute 'half': expected none, full"),
    Row("profile-layers-indivisible", "profile", prof("--layouts", "tp1cp1pp2", "--profile-layers", "3"), 2,
        "--profile-layers 3 is not divisible"),
    Row("profile-out-is-a-dir", "profile", prof("--out", "{d}"), 1, "is a directory, not a file"),
    Row("profile-out-under-a-file", "profile", prof("--out", "{d}/afile/p.json"), 1, "afile is a file, not a folder"),
    Row("profile-out-read-only", "profile", prof("--out", "{o}/ro/p.json"), 1, _PERM, needs=("ro",)),
    Row("profile-out-read-only-fs", "profile", prof("--out", "{o}/rofs/p.json"), 1, _ROFS, needs=("rofs",)),
    Row("profile-out-full-disk", "profile", prof("--out", "{o}/full/p.json"), 1, _FULL, needs=("full",)),
]


def _param(row: Row):
    return pytest.param(row, id=row.id, marks=[pytest.mark.dist] if row.needs else [])


def _fill(argv, d: str, o: str | None) -> list[str]:
    return [a.replace("{d}", d).replace("{o}", o or "{o}") for a in argv]


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_row(row: Row, inputs, capsys, request):
    o = None
    if row.needs:
        o, unavailable = request.getfixturevalue("outputs")
        missing = [unavailable[n] for n in row.needs if n in unavailable]
        if missing:
            pytest.skip(missing[0])
    result = call(row.tool, _fill(row.argv, inputs, o), capsys)
    assert_one_line(result, row.code, row.needle, PREFIX.get(row.tool, ""))
    if row.left:
        folder = _fill([row.left], inputs, o)[0]
        assert [n for n in os.listdir(folder) if n != "lost+found"] == [], os.listdir(folder)


# ------------------------------------------------------------------ Ctrl-C: one line, 130
def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


INTERRUPTS = [  # (tool, argv, where the Ctrl-C lands)
    ("plan", plan(), "dcp_ext.cli.plan.make_planner"),
    ("simulate", sim(), "dcp_ext.cli.simulate.make_planner"),
    ("stats", stats(), "dcp_ext.data.stats_report.report"),
    ("preprocess", prep(), "dcp_ext.data.preprocess._encode"),
    ("profile", prof(), "dcp_ext.cli.profile.time_points"),
]


@pytest.mark.parametrize("tool,argv,where", INTERRUPTS, ids=[t for t, _, _ in INTERRUPTS])
def test_ctrl_c_is_one_line(tool, argv, where, inputs, capsys, monkeypatch):
    monkeypatch.setattr(where, _interrupt)
    result = call(tool, _fill(argv, inputs, None), capsys)
    assert_one_line(result, 130, "interrupted (Ctrl-C)", PREFIX.get(tool, ""))
    for folder in ("prep", "prof"):
        path = os.path.join(inputs, folder)
        assert not os.path.isdir(path) or os.listdir(path) == [], os.listdir(path)


# ------------------------------------------------------------------ the scripts themselves
@pytest.mark.dist
@pytest.mark.parametrize("script,argv,needle", [
    ("tools/preprocess_data.py", prep(out="{o}/ro/x"), _PERM),
    ("tools/dataset_stats.py", stats("--lengths-file", "{d}/huge.txt"), "is too large"),
], ids=["preprocess_data.py", "dataset_stats.py"])
def test_scripts_say_one_line(script, argv, needle, inputs, outputs):
    from tests.support.helpers import run_tool

    o, unavailable = outputs
    if "{o}/ro" in " ".join(argv) and "ro" in unavailable:
        pytest.skip(unavailable["ro"])
    r = run_tool(script, _fill(argv, inputs, o), timeout=300)
    assert_one_line(r, 1, needle, os.path.basename(script) + ": ")


@pytest.mark.dist
def test_a_real_ctrl_c_reaches_preprocess_and_its_workers(tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C: the driver says one line and
    exits 130, its --workers say nothing, and no dataset (or staging file) is left."""
    import signal
    import time

    from tests.support.helpers import kill_tree, rank_env, sigint_as_a_terminal_gives_it

    src, out = tmp_path / "big.jsonl", tmp_path / "out"
    src.write_text((json.dumps({"text": "y" * 4000}) + "\n") * 8000)  # seconds of tokenizing
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(src), "--output-prefix",
           str(out / "x"), "--tokenizer-type", "ByteLevelTokenizer", "--workers", "2", "--no-progress"]
    with open(tmp_path / "stdout", "w+") as so, open(tmp_path / "stderr", "w+") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=rank_env(), start_new_session=True,
                                preexec_fn=sigint_as_a_terminal_gives_it)
        try:
            while proc.poll() is None and not (out.is_dir() and any(n.endswith(".bin") for n in os.listdir(out))):
                time.sleep(0.05)  # the staging file: the workers are starting on the lines
            time.sleep(0.5)
            assert proc.poll() is None, "the run ended before the Ctrl-C"
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
        se.seek(0)
        result = subprocess.CompletedProcess(cmd, code, "", se.read())
    assert_one_line(result, 130, "interrupted (Ctrl-C); no output written", "preprocess_data.py: ")
    assert os.listdir(out) == [], os.listdir(out)


# ------------------------------------------------------------------ the boundary itself
def test_the_boundary_lets_bugs_and_plain_exits_through(capsys):
    """Only bad input becomes a line: a bug (any other exception) still raises with its
    traceback, and --help's exit 0 stays an exit."""
    from dcp_ext.cli.boundary import run_tool

    def bug():
        raise ZeroDivisionError("a bug")

    def helped():
        raise SystemExit(0)

    with pytest.raises(ZeroDivisionError):
        run_tool(bug, errors={KeyError: 1})
    with pytest.raises(SystemExit) as e:
        run_tool(helped)
    assert e.value.code == 0 and capsys.readouterr().err == ""
    missing = FileNotFoundError(2, "No such file or directory", "/no/such/file")
    assert run_tool(lambda: (_ for _ in ()).throw(missing)) == 1
    assert capsys.readouterr().err == "error: /no/such/file: no such file or directory; check the path\n"

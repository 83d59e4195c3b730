"""The tools a newcomer meets first say what they do, in one process: every shortfall of the
work asked for is a line (dcp-simulate/dcp-plan: fewer iterations than --iterations, documents
cut to --max-seq-len, a timeline iteration past the run), progress reads as plain lines in a
log, the timeline has a legend and readable labels, dataset_stats.py writes an image only
where --png says, dcp-profile --quick plans a small grid and says how many runs at start.
The README's commands as written: tests/tools/test_readme_commands.py."""
import io
import os
import sys

import numpy as np
import pytest

from dcp_ext.cli import simulate as sim_cli

SIM = ["--model", "demo", "--cluster", "cpu-gloox4", "--global-batch-tokens", "8192", "--quiet"]


def _lengths(tmp_path, lens):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(str(int(x)) for x in lens) + "\n")
    return str(p)


def test_simulate_says_each_shortfall_in_one_line(tmp_path, capsys):
    lens = [1000] * 30 + [5000, 300]  # 32,348 tokens at max-seq-len 2048: 3.9 batches of 8192, cut into 5
    path = _lengths(tmp_path, lens)
    png = tmp_path / "t.png"
    rc = sim_cli.main(["--lengths", path, "--max-seq-len", "2048", "--iterations", "10", "--planners", "static",
                       "--timeline", str(png), "--timeline-iteration", "7", "--timeline-planner", "adaptive"] + SIM)
    assert rc == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"dcp-simulate: --iterations 10: {path} holds 3.9 global batches of 8192 tokens from --start 0; running 5, "
        "the last one 300 tokens (4% of a batch)",
        "dcp-simulate: 1 of 32 documents in these batches are longer than --max-seq-len 2048 and are cut to it: "
        "8.4% of their tokens are not planned",
        "dcp-simulate: --timeline-planner adaptive was not run (or could not plan); the timeline draws static",
        "dcp-simulate: --timeline-iteration 7 is past the 5 iterations run; the timeline draws iteration 4"]
    # as many full batches as asked: nothing to say
    rc = sim_cli.main(["--lengths", path, "--max-seq-len", "2048", "--iterations", "2", "--planners", "static"] + SIM)
    assert rc == 0 and capsys.readouterr().err.strip() == ""


def test_plan_says_the_file_ended(tmp_path, capsys):
    from dcp_ext.cli import plan as plan_cli

    path = _lengths(tmp_path, [1000] * 20)
    rc = plan_cli.main(["--lengths", path, "--max-seq-len", "2048", "--iterations", "3", "--planner", "static",
                        "--out", str(tmp_path / "p.json")] + SIM)
    assert rc == 0
    err = capsys.readouterr().err
    assert f"dcp-plan: {path} ends in iteration 2; running 3, the last one 4000 tokens (49% of a batch)" in err


def test_progress_in_a_log_is_plain_rate_limited_lines(monkeypatch):
    from dcp_ext.data.progress import Progress
    from dcp_ext.planning.planners.candidates import stderr_progress

    log = io.StringIO()  # not a TTY
    with Progress("work", total=1000, unit="it", stream=log) as bar:
        for _ in range(1000):
            bar.update(1)
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("work: [########################] 100.0% 1.0K/1.0Kit")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    cb = stderr_progress("adaptive: candidate layouts")
    for k in range(1, 20):
        cb(k, 19)
    text = sys.stderr.getvalue()
    assert "\r" not in text
    assert text.splitlines() == ["adaptive: candidate layouts: [#-----------------------] 1/19",
                                 "adaptive: candidate layouts: [########################] 19/19"]


def test_quick_warm_up_runs_each_layouts_first_point_once():
    from dcp_ext.cli.profile import Job, warmup_order

    points = [{"tp": t, "cp": 1, "pp": 1, "lengths": [n]} for t in (1, 2) for n in (32, 256)]
    assert warmup_order(Job(None, points, warmup_points="one")) == [0, 2]
    assert warmup_order(Job(None, points)) == [0, 1, 2, 3]


def test_progress_shows_a_slow_rate_as_a_fraction():
    from dcp_ext.data.progress import _human

    assert _human(0.5) == "0.5" and _human(0.04) == "0.04" and _human(3.0) == "3" and _human(2500) == "2.5K"


def _plan(cluster: str, lengths, planner="static", **kw):
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.specs import ClusterSpec, ModelSpec

    model, cl = ModelSpec.from_preset("llama2-7b"), ClusterSpec.from_preset(cluster)
    p = make_planner(planner, model, cl, max_seq_len=4096, global_batch_tokens=sum(lengths), length_sample=lengths,
                     **kw)
    it = p.plan_iteration(0, list(range(len(lengths))), list(lengths))
    return p.cm, it


def _texts(fig):
    ax = fig.axes[0]
    labels = [t for t in ax.get_yticklabels() if t.get_text()]
    legend = ax.get_legend()
    return ax, labels, legend


def test_timeline_has_a_legend_and_readable_labels():
    import matplotlib.pyplot as plt

    from dcp_ext.planning.timeline import timeline_figure

    lengths = [4096] * 64 + [512] * 64
    cm, it = _plan("h200x64", lengths, layout=(1, 1, 1))  # 64 data-parallel replicas
    assert len(it.replicas) == 64
    fig = timeline_figure(cm, it, dict(enumerate(lengths)))
    ax, labels, legend = _texts(fig)
    assert [t.get_text() for t in labels] == ["r0-r63: 64 x tp1cp1pp1, ranks 0-63"]  # one group, not 64 labels
    assert min(t.get_fontsize() for t in labels) >= 9
    entries = [t.get_text() for t in legend.get_texts()]
    assert entries[:4] == ["parameter pull", "gradient push", "forward (solid)", "backward (hatched)"]
    assert entries[4].startswith("micro-batch 0, 1, 2")
    plt.close(fig)
    cm, it = _plan("h200x8", [4096] * 8, layout=(2, 1, 2))  # few replicas: one label each, with their stages
    fig = timeline_figure(cm, it, {i: 4096 for i in range(8)})
    ax, labels, legend = _texts(fig)
    assert [t.get_text() for t in labels] == [f"r{k} tp2cp1pp2, ranks {4 * k}-{4 * k + 3} (pp2)" for k in range(2)]
    plt.close(fig)


def test_lane_groups_label_runs_of_one_layout():
    from dcp_ext.planning.timeline import lane_groups

    lanes = [(0, "tp2cp4pp1", tuple(range(8))), (1, "tp2cp4pp1", tuple(range(8, 16))), (2, "tp1cp1pp1", (16,)),
             (3, "tp1cp1pp1", (17,)), (4, "tp4cp1pp1", (18, 19, 20, 21))]
    assert lane_groups(lanes) == [(0, 1, "r0-r1: 2 x tp2cp4pp1, ranks 0-15 (8 each)"),
                                  (2, 3, "r2-r3: 2 x tp1cp1pp1, ranks 16-17"),
                                  (4, 4, "r4 tp4cp1pp1, ranks 18-21")]


def test_dataset_stats_writes_an_image_only_where_asked(tmp_path, capsys, monkeypatch):
    from dcp_ext.data.stats_report import main

    lf = tmp_path / "lengths.txt"
    lf.write_text("\n".join(str(n) for n in (10, 200, 3000, 70)))
    monkeypatch.chdir(tmp_path)
    assert main(["--lengths-file", str(lf), "--seq-length", "128"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["lengths.txt"]  # nothing written
    assert "no histogram image (pass --png FILE for one)" in capsys.readouterr().out
    assert main(["--lengths-file", str(lf), "--seq-length", "128", "--png", "h.png"]) == 0
    assert f"histogram image: {tmp_path / 'h.png'}" in capsys.readouterr().out
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_preprocess_sft_says_the_dataset_it_writes(tmp_path, capsys):
    from dcp_ext.data.preprocess import build_parser, run

    src = tmp_path / "chat.jsonl"
    src.write_text('{"prompt": "2+2?", "response": "4"}\n{"prompt": "3+3?", "response": "6"}\n')
    out = str(tmp_path / "out")
    run(build_parser().parse_args(["--input", str(src), "--output-prefix", out, "--tokenizer-type",
                                   "ByteLevelTokenizer", "--sft", "--no-progress", "--json-keys", "body"]))
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"preprocess_data.py: --sft writes one dataset, {out}_sft_document (.bin/.idx, with its loss "
                      f"mask {out}_sft_document_loss_mask), from the prompt/response or chat messages of each line; "
                      "--json-keys body is not used")
    assert err[-1] == (f"preprocess_data.py: train on it with --data-path {out}_sft_document (the loss mask beside it "
                       "is read too: only the responses are trained)")
    assert os.path.isfile(out + "_sft_document.bin")


def _profile_argv(*extra):
    return ["--yaml-cfg", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                                       "cpu_demo.yaml"), "--nproc", "2", "--layouts", "tp1cp1pp1,tp2cp1pp1"] + list(extra)


@pytest.mark.parametrize("extra,points,runs", [
    (["--quick"], 24, 26),  # 2 layouts x 2 recompute x 3 lengths x 2 packings, 1 timed; 1 warm-up run per layout
    (["--quick", "--repeats", "3", "--warmup-points", "all"], 24, 96),  # explicit flags win over --quick's
    ([], 72, 432),  # the full grid: 6 lengths x 3 packings, 1 warm-up + 5 timed runs each
])
def test_profile_quick_plans_a_small_grid_and_says_so(tmp_path, capsys, monkeypatch, extra, points, runs):
    from dcp_ext.cli import profile
    from megatron.training.adaptive.profiling import SIDE

    seen = {}

    def fake_time_points(job):  # no ranks: what would be timed
        seen["points"], seen["runs"] = len(job.points), profile.planned_runs(job)
        return [profile.Timing(p, samples=[0.01 * (1 + sum(p["lengths"]) / 1000)] * job.repeats) for p in job.points]

    monkeypatch.setattr(profile, "time_points", fake_time_points)
    out = tmp_path / "p.json"
    assert profile.main(_profile_argv(*extra, "--out", str(out)), SIDE) == 0
    assert seen == {"points": points, "runs": runs}
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(f"= {runs} runs" + (" (--quick: a rough profile)" if extra else ""))
    assert ("of 2 (one per layout)" in err[0]) == (extra == ["--quick"])
    assert err[1].startswith("dcp-profile: the analytic cost model expects about ") and " s of runs" in err[1]
    assert out.is_file()


def test_profile_says_which_layouts_the_cores_leave_out(tmp_path, capsys, monkeypatch):
    from dcp_ext.cli import profile
    from megatron.training.adaptive.profiling import SIDE

    monkeypatch.setattr(profile, "usable_cores", lambda: 2)
    monkeypatch.setattr(profile, "time_points", lambda job: [profile.Timing(p, samples=[0.01]) for p in job.points])
    argv = _profile_argv("--quick", "--out", str(tmp_path / "p.json"))
    argv = argv[:argv.index("--nproc")] + argv[argv.index("--layouts") + 2:]  # default --nproc 4, default layouts
    assert profile.main(argv + ["--recompute", "none"], SIDE) == 0
    err = capsys.readouterr().err
    assert ("dcp-profile: layouts of more than 2 ranks are not timed (tp1cp1pp4, tp1cp2pp2, tp1cp4pp1, tp2cp1pp2, "
            "tp2cp2pp1, tp4cp1pp1): this machine has 2 cores for --nproc 4") in err

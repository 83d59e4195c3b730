"""Upstream's training-loop and checkpoint flags, on the real command (static and --dcp):
sample-based schedules, decoupled LR, exit on SIGTERM / duration, profiling, timers,
--num-workers, --no-save-optim/--no-save-rng, --use-checkpoint-args."""
import gzip
import json
import math
import os
import signal
import time

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import drop_flags, kill_tree, read_loss_log, run_ranks, start_ranks
from tests.support.helpers import assert_one_line_error

pytestmark = pytest.mark.dist


SAMPLE_MODEL = drop_flags(TINY_MODEL, "--lr-warmup-iters", "--lr-decay-iters")
STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4", "--reset-attention-mask", "--reset-position-ids"]


def parse(flags, world_size=1):
    from megatron.training.arguments import parse_args

    return parse_args(flags, world_size=world_size)


# ---- the schedule counts samples ----------------------------------------------------------

def expected_lr(samples, *, lr, min_lr, warmup, decay):
    """Megatron's cosine schedule, written out: linear warmup from 0, cosine to min_lr, then min_lr."""
    if warmup and samples <= warmup:
        return lr * samples / warmup
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


@pytest.mark.parametrize("warmup_flags,warmup", [(["--lr-warmup-samples", "24"], 24),
                                                 (["--lr-warmup-fraction", "0.25"], 0.25 * 160)])
def test_lr_follows_samples(warmup_flags, warmup):
    import torch

    from megatron.training.flags.core_configs import build_lr_scheduler

    args = parse(SAMPLE_MODEL + ["--mock-data", "--global-batch-size", "8", "--train-samples", "203",
                                 "--lr-decay-samples", "160"] + warmup_flags)
    assert args.train_iters == 203 // 8
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    sched = build_lr_scheduler(args, opt)
    for it in range(1, args.train_iters + 1):
        sched.step(increment=args.lr_step_increment)
        want = expected_lr(8 * it, lr=1e-3, min_lr=1e-4, warmup=warmup, decay=160)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-9), it


@pytest.mark.parametrize("extra,needle", [
    (["--train-samples", "64", "--train-iters", "4"], "--train-samples and --train-iters are mutually exclusive"),
    (["--train-samples", "64", "--lr-decay-iters", "4"], "--train-samples and --lr-decay-iters"),
    (["--train-samples", "64", "--lr-warmup-iters", "1"], "--train-samples and --lr-warmup-iters"),
    (["--train-samples", "64", "--lr-warmup-samples", "8", "--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction and"),
    (["--train-iters", "4", "--lr-decay-samples", "64"], "--lr-decay-samples needs --train-samples"),
    (["--train-samples", "64", "--lr-warmup-samples", "64"], "must be shorter than --lr-decay-samples"),
    (["--train-samples", "3"], "less than one global batch"),
    (["--train-iters", "4", "--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--train-iters", "4", "--profile", "--profile-step-start", "3", "--profile-step-end", "3"], "--profile-step-end"),
    (["--train-iters", "4", "--wandb-exp-name", "x"], "without --wandb-project"),
    (["--train-iters", "4", "--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
])
def test_flag_relations_refused_in_one_line(extra, needle):
    from megatron.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as e:
        parse(SAMPLE_MODEL + ["--mock-data", "--global-batch-size", "8"] + extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_save_interval_without_save_is_accepted():
    args = parse(TINY_MODEL + ["--mock-data", "--train-iters", "4", "--save-interval", "2"])
    assert args.save is None and args.save_interval == 2


def test_wandb_refused_by_the_real_command():
    # (--ckpt-format torch, refused the same way, is a row of test_bad_inputs.py)
    try:
        import wandb  # noqa: F401
    except ImportError:
        r = run_ranks(1, TINY_MODEL + ["--mock-data", "--train-iters", "2", "--wandb-project", "p", "--save", "/tmp/x"])
        assert_one_line_error(r, "pip install wandb")


# ---- one static run with many loop flags, and the same run read by workers ----------------

@pytest.fixture(scope="module")
def static_runs(text_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    common = SAMPLE_MODEL + STATIC + data + ["--train-samples", "18", "--lr-warmup-samples", "4",
                                             "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]
    log = str(root / "main.jsonl")
    r = run_ranks(1, common + ["--loss-log", log, "--log-throughput", "--timing-log-level", "2", "--manual-gc",
                               "--manual-gc-interval", "2", "--empty-unused-memory-level", "2", "--profile",
                               "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
                               "--tensorboard-dir", str(root / "tb"), "--save", str(root / "ckpt"), "--no-save-optim",
                               "--no-save-rng"])
    assert r.returncode == 0, r.stderr[-3000:]
    wlog = str(root / "workers.jsonl")
    w = run_ranks(1, common + ["--loss-log", wlog, "--num-workers", "2"])
    assert w.returncode == 0, w.stderr[-3000:]
    return root, data, r, read_loss_log(log), read_loss_log(wlog), w


def test_train_samples_runs_the_derived_iterations(static_runs):
    _, _, r, log, _, _ = static_runs
    assert [x["iteration"] for x in log] == [1, 2, 3, 4]  # 18 // 4
    assert log[-1]["consumed samples"] == 16
    # lr and decoupled lr: warmup over 4 samples, cosine to min over 18 (one iteration = 4 samples)
    for x in log:
        s = 4 * x["iteration"]
        assert x["lr"] == pytest.approx(expected_lr(s, lr=1e-3, min_lr=1e-4, warmup=4, decay=18), rel=1e-9)
        assert x["decoupled lr"] == pytest.approx(expected_lr(s, lr=3e-3, min_lr=3e-4, warmup=4, decay=18), rel=1e-9)
    assert "decoupled learning rate:" in r.stdout


def test_log_throughput_timers_and_profile(static_runs):
    root, _, r, _, _, _ = static_runs
    lines = [line for line in r.stdout.splitlines() if " iteration " in line and "lm loss" in line]
    tflops = [float(line.split("throughput per GPU (TFLOP/s/GPU): ")[1].split(" ")[0]) for line in lines]
    assert len(tflops) == 4 and all(t > 0 for t in tflops)
    assert "forward-backward" in r.stdout and "optimizer" in r.stdout and "(min, max) time across ranks" in r.stdout
    trace = root / "tb" / "torch_profile" / "rank-0.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)


def test_throughput_field_only_with_the_flag(static_runs):
    w = static_runs[-1]  # no --log-throughput: upstream's line then has no throughput field
    assert " lm loss: " in w.stdout and "TFLOP/s/GPU" not in w.stdout


def test_num_workers_reads_the_same_samples(static_runs):
    _, _, _, log, wlog, _ = static_runs
    assert [x["lm loss"] for x in wlog] == [x["lm loss"] for x in log]


def test_no_save_optim_checkpoint(static_runs, tmp_path):
    root, data, _, _, _, _ = static_runs
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(root / "ckpt" / "iter_0000004")).read_metadata().state_dict_metadata
    assert not any(k.startswith("optimizer") for k in keys) and not any("rng" in k for k in keys)
    assert any(k.startswith("decoder.") for k in keys)
    base = SAMPLE_MODEL + STATIC + data + ["--train-samples", "24", "--load", str(root / "ckpt")]
    r = run_ranks(1, base)
    assert_one_line_error(r, "resume with --no-load-optim --no-load-rng")
    # --use-checkpoint-args: the model shape comes from the checkpoint (no model flags given)
    shape = ["--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
             "--seq-length", "--max-position-embeddings", "--position-embedding-type", "--normalization"]
    bare = [f for f in drop_flags(base, *shape) if f not in ("--swiglu", "--disable-bias-linear")]
    log = str(tmp_path / "resumed.jsonl")
    r = run_ranks(1, bare + ["--use-checkpoint-args", "--no-load-optim", "--no-load-rng", "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["iteration"] for x in read_loss_log(log)] == [5, 6]
    assert "loaded checkpoint" in r.stdout


# ---- exit conditions ----------------------------------------------------------------------

def test_exit_duration_stops_and_saves(text_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    log = str(tmp_path / "loss.jsonl")
    r = run_ranks(1, TINY_MODEL + STATIC + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                                            "--train-iters", "100000", "--exit-duration-in-mins", "0.05",
                                            "--save", save, "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exiting program after" in r.stdout
    last = read_loss_log(log)[-1]["iteration"]
    assert 1 <= last < 100000
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(last)
    assert os.path.isfile(os.path.join(save, f"iter_{last:07d}", "metadata.json"))


def _start(flags, nproc, out_path):
    out = open(out_path, "w")
    return start_ranks(nproc, flags, out), out


def _wait_for_lines(path, n, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and len(read_loss_log(path)) >= n:
            return
        assert proc.poll() is None, "the run ended before it was signalled"
        time.sleep(0.2)
    raise AssertionError(f"{path}: fewer than {n} iterations after {timeout} s")


def _workers(proc):
    import psutil

    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "pretrain_gpt_dcp.py" in " ".join(p.cmdline())
            and p.ppid() == proc.pid]


def test_sigterm_to_the_ranks_saves_and_resumes_exactly(text_corpus, tmp_path):
    """SLURM's preemption signals every task: each rank finishes its iteration, saves, exits 0."""
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    flags = TINY_MODEL + STATIC + data + ["--tensor-model-parallel-size", "2"]
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "first.jsonl")
    # one --train-iters for all three runs: the static dataset's sample order depends on it
    flags += ["--train-iters", "200"]
    proc, out = _start(flags + ["--save", save, "--exit-signal-handler",
                                "--loss-log", log], 2, tmp_path / "first.out")
    try:
        _wait_for_lines(log, 2, proc)
        for p in _workers(proc):
            p.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=240)
    finally:
        kill_tree(proc)
        out.close()
    text = open(tmp_path / "first.out").read()
    assert code == 0, text[-3000:]
    assert "exiting program after receiving SIGTERM" in text
    stopped = read_loss_log(log)[-1]["iteration"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped)
    # the checkpoint is complete: it resumes, and the resumed losses are an unbroken run's
    resumed, full = str(tmp_path / "resumed.jsonl"), str(tmp_path / "full.jsonl")
    stop = ["--exit-interval", str(stopped + 2)]
    r = run_ranks(2, flags + stop + ["--load", save, "--loss-log", resumed])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_ranks(2, flags + stop + ["--loss-log", full])
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = read_loss_log(resumed), read_loss_log(full)[stopped:]
    assert [x["iteration"] for x in got] == [stopped + 1, stopped + 2]
    assert [x["lm loss"] for x in got] == [x["lm loss"] for x in want]


def test_sigterm_to_torchrun_under_dcp_saves_a_complete_checkpoint(text_corpus, tmp_path):
    """torchrun forwards the signal to its workers; the adaptive loop saves before it goes."""
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    flags = SAMPLE_MODEL + data + ["--dcp", "--dcp-global-batch-tokens", "512", "--global-batch-size", "4",
                                   "--dcp-recalibration", "off"]
    save, log = str(tmp_path / "ckpt"), str(tmp_path / "first.jsonl")
    proc, out = _start(flags + ["--train-samples", "400000", "--save", save, "--exit-signal-handler", "--loss-log",
                                log, "--log-throughput"], 2, tmp_path / "first.out")
    try:
        _wait_for_lines(log, 2, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=240)
    finally:
        kill_tree(proc)
        out.close()
    text = open(tmp_path / "first.out").read()
    assert "exiting program after receiving SIGTERM" in text, text[-3000:]
    assert "throughput per GPU (TFLOP/s/GPU)" in text
    stopped = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert stopped >= 2 and os.path.isfile(os.path.join(save, f"iter_{stopped:07d}", "metadata.json"))
    first = read_loss_log(log)
    assert first[1]["lr"] == pytest.approx(expected_lr(8, lr=1e-3, min_lr=1e-4, warmup=0, decay=400000), rel=1e-9)
    resumed = str(tmp_path / "resumed.jsonl")
    r = run_ranks(2, flags + ["--train-samples", "400000", "--exit-interval", str(stopped + 1), "--load", save,
                              "--loss-log", resumed])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["iteration"] for x in read_loss_log(resumed)] == [stopped + 1]


@pytest.mark.dist
def test_dcp_logs_both_learning_rates_from_any_rank(text_corpus, tmp_path):
    """--decoupled-lr under --dcp on 4 ranks: the last rank logs, and its shard may hold only
    the embedding's elements; the log still gives the model's LR and the decoupled one."""
    log = str(tmp_path / "loss.jsonl")
    flags = TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"), "--dcp",
                          "--dcp-global-batch-tokens", "1024", "--dcp-max-seq-len", "128", "--train-iters", "3",
                          "--lr-decay-iters", "8", "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4",
                          "--loss-log", log]
    r = run_ranks(4, flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "NAN" not in r.stdout.upper().replace("NUMBER OF NAN ITERATIONS", ""), r.stdout[-2000:]
    for x in read_loss_log(log):
        i = x["iteration"]  # one step a sample here: the schedule counts iterations, warmup 1 of decay 8
        assert x["lr"] == pytest.approx(expected_lr(i, lr=1e-3, min_lr=1e-4, warmup=1, decay=8), rel=1e-9)
        assert x["decoupled lr"] == pytest.approx(expected_lr(i, lr=3e-3, min_lr=3e-4, warmup=1, decay=8), rel=1e-9)

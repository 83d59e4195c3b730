"""Upstream's own launch lines run here unchanged but for sizes and paths.

`tests/fixtures/upstream/*.args` are the argument lists two of upstream Megatron-LM's Llama-3 8B
example scripts pass to `pretrain_gpt.py`. A user swaps in `pretrain_gpt_dcp.py`; only what
the machine forces may change: model and batch sizes, sample counts, and paths. The fp8 flags
need transformer-engine on an FP8 GPU and Megatron FSDP is not wired in: on this CPU each is
refused, all of them in one line naming each (checked here: drop the flags named, launch
again, one iteration on one process, forked from tests/support/entry_runner.py's server), and the line
without them trains, on 4 CPU ranks, as it is and with `--dcp` added; the loss falls.
"""
from __future__ import annotations

import os

import pytest

from tests.support.entry_runner import make_runner
from tests.support.helpers import REPO, drop_flags, read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error

pytestmark = [pytest.mark.dist, pytest.mark.slow]

UPSTREAM = os.path.join(REPO, "tests", "fixtures", "upstream")
LINES = ["llama3_8b_h100_fp8.args", "llama3_8b_fsdp_h100_fp8.args"]

# The sizes a 2-core CPU can train in seconds; every other value stays as upstream wrote it.
SIZES = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "160", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "128", "--max-position-embeddings": "128",
    "--vocab-size": "512", "--micro-batch-size": "1", "--global-batch-size": "8",
    "--train-samples": "96", "--lr-decay-samples": "96", "--lr-warmup-samples": "8", "--eval-iters": "1",
}
PATHS = ("--save", "--load", "--tensorboard-dir", "--data-cache-path")
# What this CPU build may refuse of those lines: fp8 (transformer-engine on an FP8 GPU) and
# Megatron FSDP with its checkpoint format, all named in one line. Anything else refused is a failure.
MAY_REFUSE = {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
              "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--fsdp-double-buffer",
              "--fsdp-manual-registration", "--use-nccl-ub", "--init-model-with-meta-device", "--ckpt-format"}


def read_line(name: str) -> list[str]:
    with open(os.path.join(UPSTREAM, name)) as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]


def shrink(argv: list[str], tmp: str, sizes: dict | None = None, paths=PATHS) -> list[str]:
    """`argv` with each flag of `sizes` given that value (all its values replaced by it) and each
    flag of `paths` pointed into `tmp` (same base name); every other token as it was."""
    sizes = SIZES if sizes is None else sizes
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in sizes or flag in paths:
            value = sizes.get(flag) or os.path.join(tmp, os.path.basename(argv[i + 1]))
            out += [flag] + (value if isinstance(value, list) else [value])
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        else:
            out.append(flag)
            i += 1
    return out


def runnable_here(runner, argv: list[str]) -> tuple[list[str], list[str]]:
    """Launch the line; if refused, the refusal must be one line naming every refused flag at
    once (all of them flags the line holds): drop them, and the line must launch. Returns the
    runnable line and the flags refused, in the order named."""
    from tests.training.test_upstream_examples import refused_flags

    one_iteration = ["--train-samples", "8"]
    proc = runner.run(drop_flags(argv, "--train-samples") + one_iteration, timeout=300)
    if proc.returncode == 0:
        return argv, []
    assert_one_line_error(proc, "error: ")
    refused = refused_flags(proc.stderr)
    assert refused and all(flag in argv for flag in refused), proc.stderr
    argv = drop_flags(argv, *refused)
    proc = runner.run(drop_flags(argv, "--train-samples") + one_iteration, timeout=300)
    assert proc.returncode == 0, f"refused again after dropping {refused}: {proc.stderr[-2000:]}"
    return argv, refused


@pytest.fixture(scope="module")
def runnable(tmp_path_factory):
    out = {}
    runner = make_runner(str(tmp_path_factory.mktemp("runs")))
    try:
        for name in LINES:
            tmp = str(tmp_path_factory.mktemp(name.split(".")[0]))
            out[name] = runnable_here(runner, shrink(read_line(name), tmp))[1]
    finally:
        runner.close()
    return out


@pytest.mark.parametrize("name", LINES)
def test_only_fp8_and_fsdp_are_refused_each_in_one_line(runnable, name):
    refused = runnable[name]
    assert "--fp8-format" in refused, refused
    assert set(refused) <= MAY_REFUSE, f"refused beyond fp8/FSDP: {set(refused) - MAY_REFUSE}"
    if "fsdp" in name:
        assert "--use-megatron-fsdp" in refused, refused


@pytest.mark.parametrize("dcp", [False, True], ids=["static", "dcp"])
@pytest.mark.parametrize("name", LINES)
def test_upstream_line_trains_on_four_cpu_ranks(runnable, name, dcp, tmp_path):
    argv = shrink(read_line(name), str(tmp_path))
    for flag in runnable[name]:
        argv = drop_flags(argv, flag)
    log = str(tmp_path / "loss.jsonl")
    argv += ["--loss-log", log] + (["--dcp"] if dcp else [])
    proc = run_ranks(4, argv, timeout=900, torchrun=True)  # the drop-in claim: upstream's launcher
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["lm loss"] for r in read_loss_log(log)]
    assert len(losses) == 96 // 8, losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.05, losses
    assert "error" not in proc.stderr.lower(), proc.stderr[-2000:]

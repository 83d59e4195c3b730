"""No NaN step is applied or saved (issue 24, class C).

A step whose loss is finite but whose gradient norm is NaN used to be applied on the static
path (megatron-core's fp32/bf16 step clips by the NaN norm): every later checkpoint held NaN
weights and the tracker named one. Now the static path skips it as --dcp does, and no
checkpoint of either path is written from non-finite weights. The faults come from the test
hooks `DCP_FAULT_INJECT=nan_grad@N` (one gradient element NaN at iteration N, every rank)
and `nan_weights@N` (one weight NaN after iteration N's step).
"""
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error

pytestmark = pytest.mark.dist

STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4"]
DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]


def run(corpus, tmp_path, path, name, *extra, fault=None, nproc=2):
    log = str(tmp_path / f"{name}.jsonl")
    flags = TINY_MODEL + (DCP if path == "dcp" else STATIC) + [
        "--data-path", corpus, "--data-cache-path", str(tmp_path / "cache"), "--loss-log", log, *extra]
    r = run_ranks(nproc, flags, env={"DCP_FAULT_INJECT": fault} if fault else None)
    return r, (read_loss_log(log) if os.path.exists(log) else [])


@pytest.mark.parametrize("path", ["static"])  # --dcp's sharded optimizer skips it in its own step
def test_a_nan_gradient_norm_is_skipped_and_never_saved(path, text_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    r, losses = run(text_corpus, tmp_path, path, "faulty", "--train-iters", "4", "--save", save,
                    "--save-interval", "2", fault="nan_grad@2")
    assert r.returncode == 0, r.stderr[-3000:]
    by_it = {x["iteration"]: x for x in losses}
    assert sorted(by_it) == [1, 2, 3, 4]
    assert by_it[2]["skipped"], by_it[2]  # not applied
    for x in losses:
        assert x["lm loss"] == x["lm loss"] and abs(x["lm loss"]) < 100, x  # finite: nothing was poisoned
    # the checkpoint of iteration 4 (after the skipped step) holds finite weights: it resumes
    r2, resumed = run(text_corpus, tmp_path, path, "resumed", "--train-iters", "5", "--load", save)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert [x["iteration"] for x in resumed] == [5]
    assert resumed[0]["lm loss"] == resumed[0]["lm loss"] and not resumed[0]["skipped"], resumed


@pytest.mark.parametrize("path", ["static", "dcp"])
def test_non_finite_weights_are_not_saved(path, text_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    r, losses = run(text_corpus, tmp_path, path, "poisoned", "--train-iters", "4", "--save", save,
                    "--save-interval", "2", fault="nan_weights@3")
    assert_one_line_error(r, "the model's weights hold NaN or inf values")
    assert "iteration 4" in r.stderr and "iteration 2) is kept" in r.stderr, r.stderr
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002"]

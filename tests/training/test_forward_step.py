"""The entry point's forward_step and loss function are honoured on both paths.

Users change exactly these (upstream's z-loss and auxiliary terms live in the loss
function). Under --dcp the runtime used to run its own loss, so a changed loss trained the
static path and silently not --dcp. Here a forward_step whose loss is the default's times
1.5 (tests/support/scaled_loss_entry.py) must give, at iteration 1 (the same weights and batch as
the default run), a logged loss 1.5 times the default's and a gradient norm 1.5 times too, on
both paths; and one that reads a batch key --dcp micro-batches lack ends in one line.
"""
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, read_loss_log, run_ranks

ENTRY = os.path.join(REPO, "tests", "support", "scaled_loss_entry.py")
FLAGS = {"static": ["--micro-batch-size", "2", "--global-batch-size", "8"],
         "dcp": ["--dcp", "--dcp-global-batch-tokens", "1024", "--dcp-max-seq-len", "128"]}


def _first(tmp_path, path, name, text_corpus, entry=None, env=None):
    log = str(tmp_path / f"{path}-{name}.jsonl")
    flags = TINY_MODEL + FLAGS[path] + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                                        "--train-iters", "2", "--tensor-model-parallel-size", "2",
                                        "--loss-log", log]
    r = run_ranks(2, flags, entry=entry or os.path.join(REPO, "pretrain_gpt_dcp.py"), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_loss_log(log)[0]


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_the_users_loss_is_the_one_trained(path, text_corpus, tmp_path):
    default = _first(tmp_path, path, "default", text_corpus)
    scaled = _first(tmp_path, path, "scaled", text_corpus, entry=ENTRY, env={"SCALED_LOSS_FACTOR": "1.5"})
    assert scaled["lm loss"] == pytest.approx(1.5 * default["lm loss"], rel=1e-6), (scaled, default)
    # the backward too (megatron-core's cross entropy rounds the logits' gradient to bf16 in
    # any dtype: the gradient is linear in the loss to about that rounding; unscaled would be 1x)
    assert scaled["grad norm"] == pytest.approx(1.5 * default["grad norm"], rel=2e-3), (scaled, default)


@pytest.mark.dist
def test_a_batch_key_dcp_lacks_is_one_line(text_corpus, tmp_path):
    flags = TINY_MODEL + FLAGS["dcp"] + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                                         "--train-iters", "1"]
    r = run_ranks(1, flags, entry=ENTRY, env={"SCALED_LOSS_READS": "attention_mask"})
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "batch['attention_mask']" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


ZLOSS = os.path.join(REPO, "tests", "support", "zloss_entry.py")


@pytest.mark.dist
@pytest.mark.parametrize("path", ["static", "dcp"])
def test_a_z_loss_entry_point_trains_its_loss_on_both_paths(path, text_corpus, tmp_path):
    """The user's loss computed from the logits, cross entropy + coeff * logsumexp^2: the logged
    loss is (sum of cross entropy + coeff * sum of z) / tokens of the global batch, from the
    sums the entry recorded on every rank, on both paths; and the z term reaches the gradient."""
    import glob
    import json

    def run(coeff):
        side = str(tmp_path / f"{path}-{coeff}")
        flags = TINY_MODEL + FLAGS[path] + ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                                            "--train-iters", "1", "--loss-log", side + ".jsonl"]
        if path == "dcp":
            flags += ["--dcp-calibrate-at-start", "off"]  # every loss call is then the step's
        r = run_ranks(2, flags, entry=ZLOSS, env={"ZLOSS_COEFF": str(coeff), "ZLOSS_LOG": side})
        assert r.returncode == 0, r.stderr[-3000:]
        calls = [json.loads(line) for p in glob.glob(side + ".[0-9]") for line in open(p)]
        sums = {k: sum(c[k] for c in calls) for k in ("ce", "z", "tokens")}
        return read_loss_log(side + ".jsonl")[0], sums

    plain, s0 = run(0.0)
    zl, s1 = run(0.1)
    assert s0 == pytest.approx(s1, rel=1e-6) and s1["z"] > 0  # the same weights and batch
    assert plain["lm loss"] == pytest.approx(s0["ce"] / s0["tokens"], rel=1e-5)
    assert zl["lm loss"] == pytest.approx((s1["ce"] + 0.1 * s1["z"]) / s1["tokens"], rel=1e-5)
    assert abs(zl["grad norm"] - plain["grad norm"]) > 1e-3 * plain["grad norm"]

"""`--dcp-cpu-attention flash` trains the same model as the default math kernel.

The two kernels compute the same document-causal attention (tests/runtime/test_attention.py holds
them to a dense reference); this runs the real entry point both ways on 4 CPU ranks and
checks that every iteration's loss and gradient norm agree, so the flag changes speed and
memory, not what is learned. The same runs check the log's split of the exposed
communication.
"""
import pytest

from tests.conftest import DEMO
from tests.support.helpers import read_loss_log, run_ranks


def flags(cache, kernel, log):
    return ["--yaml-cfg", DEMO, "--dcp", "--dcp-planner", "static", "--data-cache-path", cache,
            "--dcp-recalibration", "off", "--dcp-global-batch-tokens", "4096", "--train-iters", "3",
            "--lr-decay-iters", "60", "--log-interval", "1", "--eval-iters", "0", "--loss-log", log,
            "--dcp-cpu-attention", kernel]


@pytest.mark.dist
def test_flash_and_math_kernels_train_the_same_model(demo_cache, tmp_path):
    runs = {}
    for kernel in ("math", "flash"):
        log = str(tmp_path / f"{kernel}.jsonl")
        r = run_ranks(4, flags(demo_cache, kernel, log))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[kernel] = read_loss_log(log)
    assert [x["iteration"] for x in runs["flash"]] == [1, 2, 3]
    for a, b in zip(runs["math"], runs["flash"]):
        assert b["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5)
        assert b["grad norm"] == pytest.approx(a["grad norm"], rel=1e-4)
    assert runs["math"][-1]["lm loss"] != runs["math"][0]["lm loss"]  # it trained
    # the log's exposed communication splits into the exchange itself (the quickest rank's
    # pull+push) and waiting for the slowest rank
    for r in runs["math"] + runs["flash"]:
        assert 0.0 < r["exchange_s"] <= r["exposed_comm_s"]

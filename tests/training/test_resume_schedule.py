"""On resume the LR schedule follows upstream's two flags (issue 24, class B).

Without either flag a schedule that differs from the checkpoint's stops the resume (rows in
test_bad_inputs.py, `resume-other-*`); `--override-opt_param-scheduler` trains with
the flags' schedule, `--use-checkpoint-opt_param-scheduler` with the checkpoint's, and the
start of the run says which. A longer --train-iters with an explicit --lr-decay-iters
changes nothing of the schedule: the resume trains on to the new end.
"""
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks

pytestmark = pytest.mark.dist

BASE = {"static": ["--micro-batch-size", "2", "--global-batch-size", "4"],
        "dcp": ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]}


def run(path, corpus, tmp_path, name, *extra):
    log = str(tmp_path / f"{name}.jsonl")
    r = run_ranks(1, TINY_MODEL + BASE[path] + ["--data-path", corpus, "--data-cache-path", str(tmp_path / "cache"),
                                                 "--loss-log", log, *extra])
    assert r.returncode == 0, r.stderr[-3000:]
    return {x["iteration"]: x for x in read_loss_log(log)}, r.stdout


@pytest.mark.parametrize("path", ["static", "dcp"])
def test_override_and_use_checkpoint_schedules(path, text_corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    original, _ = run(path, text_corpus, tmp_path, "original", "--train-iters", "2", "--save", save)
    unbroken, _ = run(path, text_corpus, tmp_path, "unbroken", "--train-iters", "3")
    flags_run, _ = run(path, text_corpus, tmp_path, "flags", "--train-iters", "3", "--lr", "5e-4")
    assert flags_run[3]["lr"] != unbroken[3]["lr"]  # the two schedules differ at iteration 3

    over, out = run(path, text_corpus, tmp_path, "override", "--train-iters", "3", "--load", save, "--lr", "5e-4",
                    "--override-opt_param-scheduler")
    assert list(over) == [3] and over[3]["lr"] == pytest.approx(flags_run[3]["lr"], rel=1e-12)
    assert "LR schedule: the flags' (--override-opt_param-scheduler): learning rate 0.0005 (flags) vs 0.001" in out

    kept, out = run(path, text_corpus, tmp_path, "kept", "--train-iters", "3", "--load", save, "--lr", "5e-4",
                    "--use-checkpoint-opt_param-scheduler")
    assert list(kept) == [3] and kept[3]["lr"] == pytest.approx(unbroken[3]["lr"], rel=1e-12)
    assert "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler)" in out

    longer, out = run(path, text_corpus, tmp_path, "longer", "--train-iters", "4", "--load", save)
    assert list(longer) == [3, 4] and longer[3]["lr"] == pytest.approx(unbroken[3]["lr"], rel=1e-12)
    assert "LR schedule: the flags and the checkpoint agree" in out

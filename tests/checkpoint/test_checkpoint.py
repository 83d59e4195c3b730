"""Checkpoints: exact resume at the same layout, resharded resume, and crash-safe saves."""
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks

pytestmark = pytest.mark.dist

COMMON = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
                       "--reset-attention-mask", "--reset-position-ids", "--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]


def run(flags, nproc, log, env=None):
    r = run_ranks(nproc, COMMON + flags + ["--loss-log", log], env=env)
    return r


@pytest.fixture(scope="module")
def runs(text_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    # uninterrupted 6 iterations at TP2
    r = run(data + TP2, 2, str(root / "full.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    # the same run stopped after 3 iterations, checkpoint at 3
    save = str(root / "save")
    r = run(data + TP2 + ["--save", save, "--save-interval", "3", "--exit-interval", "3"], 2, str(root / "first.jsonl"))
    assert r.returncode == 0, r.stderr[-3000:]
    return root, data, save, read_loss_log(str(root / "full.jsonl"))


def test_checkpoint_layout_is_megatrons(runs):
    _, _, save, _ = runs
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert os.path.isfile(os.path.join(save, "iter_0000003", "metadata.json"))
    assert not any(name.endswith(".incomplete") for name in os.listdir(save))


def test_resume_same_layout_is_bit_identical(runs):
    root, data, save, full = runs
    log = str(root / "resume_tp2.jsonl")
    r = run(data + TP2 + ["--load", save], 2, log)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = read_loss_log(log)
    assert [x["iteration"] for x in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:]):
        assert got["lm loss"] == want["lm loss"] and got["grad norm"] == want["grad norm"], (got, want)
        assert got["consumed samples"] == want["consumed samples"]


def test_resume_resharded_to_tp1_dp2(runs):
    root, data, save, full = runs
    log = str(root / "resume_dp2.jsonl")
    r = run(data + ["--load", save], 2, log)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resharded" in r.stdout
    for got, want in zip(read_loss_log(log), full[3:]):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5)
        assert got["grad norm"] == pytest.approx(want["grad norm"], rel=1e-5)


@pytest.mark.parametrize("crash_point", ["after_shards", "after_rename"])
def test_save_killed_midway_leaves_previous_checkpoint_loadable(runs, crash_point, tmp_path):
    root, data, save, full = runs
    import shutil

    work = str(tmp_path / "save")
    shutil.copytree(save, work)
    # resume from 3 and die inside the save at iteration 6
    r = run(data + TP2 + ["--load", work, "--save", work, "--save-interval", "3"], 2, str(tmp_path / "crash.jsonl"),
            env={"DCP_FAULT_INJECT": crash_point})
    assert r.returncode != 0
    assert open(os.path.join(work, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    # the previous checkpoint still loads and continues exactly
    log = str(tmp_path / "after.jsonl")
    r = run(data + TP2 + ["--load", work], 2, log)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["lm loss"] for x in read_loss_log(log)] == [x["lm loss"] for x in full[3:]]

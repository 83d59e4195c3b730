"""Bad input ends with one clear line naming the problem and a non-zero exit, no traceback."""
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.helpers import run_ranks

pytestmark = pytest.mark.dist

BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1"]


def assert_one_line_error(result, needle):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error:") and needle in lines[0], lines[0]


def test_missing_data_path(tmp_path):
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", str(tmp_path / "nope_text_document")])
    assert_one_line_error(r, "nope_text_document")


def test_corrupt_index_file(text_corpus, tmp_path):
    prefix = str(tmp_path / "bad_text_document")
    os.symlink(text_corpus + ".bin", prefix + ".bin")
    with open(text_corpus + ".idx", "rb") as f:
        data = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(b"garbage!" + data[8:])
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", prefix])
    assert_one_line_error(r, "bad_text_document.idx")


def test_invalid_layout(text_corpus):
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", text_corpus, "--tensor-model-parallel-size", "2"])
    assert_one_line_error(r, "world size 1 is not divisible by tp*pp*cp")
    assert r.returncode == 2


def test_tracker_naming_a_missing_checkpoint(text_corpus, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    r = run_ranks(1, TINY_MODEL + BATCH + ["--data-path", text_corpus, "--load", str(tmp_path)])
    assert_one_line_error(r, "iter_0000007")

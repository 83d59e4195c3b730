"""A data file changed under a running job is said in one line (issue 24, class E).

The .bin/.idx files are memory-mapped: a file another job truncated used to end the run in
SIGBUS (exit 135) with nothing printed. dcp_ext/data/file_guard.py watches every file a
dataset opens (checked once an iteration) and a C SIGBUS handler covers a read that lands
between two checks.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, kill_tree, rank_env, read_loss_log, start_ranks
from tests.support.helpers import assert_one_line_error


@pytest.fixture
def guard():
    from dcp_ext.data import file_guard

    file_guard.forget()
    yield file_guard
    file_guard.forget()


@pytest.mark.parametrize("change,needle", [
    (lambda p: os.truncate(p, 10), "changed size (100 -> 10 bytes)"),
    (lambda p: os.remove(p), "was deleted"),
    (lambda p: (open(p + ".new", "wb").write(b"y" * 100), os.replace(p + ".new", p)), "was replaced by another file"),
    (lambda p: os.utime(p, ns=(0, 10**18)), "was rewritten"),
])
def test_each_kind_of_change_is_named(guard, tmp_path, change, needle):
    from dcp_ext.data.errors import DataError

    path = str(tmp_path / "c_text_document.bin")
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    guard.watch(path)
    guard.check()  # unchanged: nothing to say
    change(path)
    with pytest.raises(DataError, match="while this job was reading it") as e:
        guard.check()
    assert needle in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


SIGBUS_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from dcp_ext.data import file_guard
    path = sys.argv[1]
    with open(path, "wb") as f:
        f.write(b"x" * (1 << 20))
    data = np.memmap(path, mode="r", dtype=np.uint8)
    file_guard.watch(path)
    os.truncate(path, 0)  # another job cuts it short between two checks
    print(int(data[-1]))  # the lost page: SIGBUS
""")


@pytest.mark.dist
def test_a_read_of_a_cut_file_is_one_line_not_a_silent_sigbus(tmp_path):
    path = str(tmp_path / "c_text_document.bin")
    r = subprocess.run([sys.executable, "-c", SIGBUS_SCRIPT, path], cwd=REPO, env=rank_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert_one_line_error(r, f"a data file was cut short while this job read it (SIGBUS reading one of: {path})")


@pytest.mark.dist
@pytest.mark.parametrize("dcp", [False, True], ids=["static", "dcp"])
def test_a_run_whose_data_is_truncated_stops_in_one_line(dcp, text_corpus, tmp_path):
    import shutil

    data = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(text_corpus + ext, data + ext)
    log = str(tmp_path / "loss.jsonl")
    path = ["--dcp", "--dcp-global-batch-tokens", "512"] if dcp else ["--micro-batch-size", "2", "--global-batch-size", "4"]
    flags = TINY_MODEL + path + ["--train-iters", "100000", "--data-path", data, "--data-cache-path",
                                 str(tmp_path / "cache"), "--loss-log", log, "--lr-decay-iters", "100000"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = start_ranks(1, flags, out, err)
        try:
            deadline = time.time() + 300
            while time.time() < deadline and proc.poll() is None:
                if os.path.exists(log) and read_loss_log(log):
                    break
                time.sleep(0.05)
            assert proc.poll() is None, open(tmp_path / "err").read()[-3000:]
            os.truncate(data + ".bin", os.path.getsize(data + ".bin") // 2)
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
    result = subprocess.CompletedProcess([], code, "", open(tmp_path / "err").read())
    assert code != 0
    assert_one_line_error(result, "copy_text_document.bin")

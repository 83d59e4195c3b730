"""megatron/training/startup/preflight.py: every output path is checked before training, and the
check itself changes nothing (the end-to-end rows are in test_bad_inputs.py, `out-*`)."""
import argparse
import os

import pytest

from megatron.training.flags.records import output_paths_for
from megatron.training.startup import preflight


def listing(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def test_good_paths_pass_and_nothing_is_created(tmp_path):
    (tmp_path / "log.jsonl").write_text("old line\n")
    args = argparse.Namespace(save=str(tmp_path / "a" / "b" / "ckpt"), loss_log=str(tmp_path / "log.jsonl"),
                              tensorboard_dir=str(tmp_path / "tb"), dcp_log_plan="/dev/null",
                              data_cache_path=str(tmp_path / "cache"), dcp=False, demo_corpus=False)
    before = listing(tmp_path)
    assert preflight.check_paths(output_paths_for(args))[1] is None
    assert listing(tmp_path) == before  # no directory made, no probe left
    assert (tmp_path / "log.jsonl").read_text() == "old line\n"  # an existing log is never written


def test_each_problem_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert preflight.check_dir("--save", str(tmp_path / "afile")).endswith(
        "afile: is a file, not a directory: point --save to a directory")
    assert "afile is a file, not a directory" in preflight.check_dir("--save", str(tmp_path / "afile" / "ckpt"))
    line = preflight.check_file("--loss-log", str(tmp_path / "nope" / "loss.jsonl"))
    assert line.startswith("--loss-log ") and "nope does not exist: create it (mkdir -p" in line
    assert "is a directory, not a file" in preflight.check_file("--loss-log", str(tmp_path))


def test_os_errors_are_said_as_such():
    import errno

    said = {code: preflight.os_problem_line(OSError(code, os.strerror(code)), "--save", "directory")[0]
            for code in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)}
    assert said == {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                    errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
                    errno.EDQUOT: "disk quota exceeded"}


def test_which_rank_checks_what():
    args = argparse.Namespace(save="s", loss_log="l", tensorboard_dir="t", dcp_log_plan="p", data_cache_path="c",
                              dcp=True, demo_corpus=False)
    flags = {r: [f for f, _, _ in preflight.paths_to_check(output_paths_for(args), r, 4)] for r in range(4)}
    assert flags[0] == ["--save", "--dcp-log-plan"]  # --dcp reads documents directly: no sample cache
    assert flags[1] == flags[2] == ["--save"]
    assert flags[3] == ["--save", "--loss-log", "--tensorboard-dir"]  # the last rank logs


def _two_ranks(rank, world_size, root):
    args = argparse.Namespace(save=os.path.join(root, "ckpt"), loss_log=os.path.join(root, "nope", "loss.jsonl"),
                              tensorboard_dir=None, dcp_log_plan=None, data_cache_path=None, dcp=False,
                              demo_corpus=False)
    try:
        preflight.check_output_paths(output_paths_for(args))
    except preflight.OutputPathError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_all_ranks_stop_with_the_same_line(tmp_path):
    """Only the last rank writes --loss-log; rank 0 stops too, with its line, not at a later collective."""
    from tests.support.helpers import run_ranks

    lines = run_ranks(2, fn=_two_ranks, args=(str(tmp_path),))
    assert lines[0] == lines[1] and "--loss-log" in lines[0] and "does not exist" in lines[0]

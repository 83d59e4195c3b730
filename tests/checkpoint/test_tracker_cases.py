"""What `--load` does with the tracker file (`latest_checkpointed_iteration.txt`) in the cases
that used to go wrong (megatron/training/checkpoint/protocol.py `resolve_load_dir`):

- missing while complete `iter_*` checkpoints are there (a tracker lost or not copied):
  refused in one line naming the newest one and how to resume from it, never "starting
  from scratch" (which then saved over them);
- missing because the first save died before its commit (the tracker's .tmp is there):
  still a fresh start, as the save protocol promises (tests/checkpoint/test_save_faults.py);
- `release` (upstream Megatron's release checkpoints, in `{load}/release/`): the weights
  load and training starts at iteration 0, as upstream does; a release folder this fork
  cannot read is refused in one line. It is never "iteration 0" silently.
"""
import hashlib
import os
import shutil

import pytest

from megatron.training.checkpoint.protocol import TRACKER, CheckpointError, read_tracker, resolve_load_dir
from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error


def args_for(load):
    return str(load)  # --load


def complete(root, name):
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, "metadata.json"), "w") as f:
        f.write("{}")


# ---------------------------------------------------------------------------------- unit
def test_no_tracker_and_no_checkpoint_starts_fresh(tmp_path, capsys):
    assert resolve_load_dir(args_for(tmp_path)) is None
    assert "starting from scratch" in capsys.readouterr().out
    assert resolve_load_dir(args_for(tmp_path / "missing")) is None


def test_no_tracker_beside_checkpoints_is_refused_naming_the_newest(tmp_path):
    for name in ("iter_0000004", "iter_0000008", "iter_0000012.incomplete"):
        complete(tmp_path, name)
    os.makedirs(tmp_path / "iter_0000010")  # not complete (no metadata.json): not a candidate
    with pytest.raises(CheckpointError) as e:
        resolve_load_dir(args_for(tmp_path))
    line = str(e.value)
    assert line.startswith(f"--load {tmp_path}: {TRACKER} is missing but {tmp_path} holds checkpoints "
                           "(newest complete: iter_0000008)")
    assert f"echo 8 > {tmp_path / TRACKER}" in line and "starting from scratch" not in line
    assert "\n" not in line


def test_no_tracker_newest_is_an_interrupted_resaves_old_copy(tmp_path):
    complete(tmp_path, "iter_0000002")
    complete(tmp_path, "iter_0000005.old")  # a re-save of 5 died between its steps 3 and 4
    with pytest.raises(CheckpointError, match=r"newest complete: iter_0000005\.old\).*echo 5 >"):
        resolve_load_dir(args_for(tmp_path))


def test_no_tracker_beside_only_incomplete_iteration_folders_is_refused(tmp_path):
    os.makedirs(tmp_path / "iter_0000003" / "mp_rank_00")  # e.g. another format, or damaged
    with pytest.raises(CheckpointError, match=r"iter_0000003 but none is a complete checkpoint"):
        resolve_load_dir(args_for(tmp_path))


def test_a_first_save_killed_before_its_commit_still_starts_fresh(tmp_path, capsys):
    complete(tmp_path, "iter_0000001")  # renamed into place, the tracker's .tmp written, not renamed
    (tmp_path / (TRACKER + ".tmp")).write_text("1")
    assert resolve_load_dir(args_for(tmp_path)) is None
    out = capsys.readouterr().out
    assert "starting from scratch" in out and "before its commit" in out


def test_exit_on_missing_checkpoint_still_wins_on_an_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint"):
        resolve_load_dir(str(tmp_path), exit_on_missing=True)


def test_a_release_tracker_loads_the_release_folder_from_iteration_0(tmp_path, capsys):
    (tmp_path / TRACKER).write_text("release\n")
    complete(tmp_path, "release")
    found = resolve_load_dir(args_for(tmp_path))
    assert (found.path, found.iteration) == (str(tmp_path / "release"), 0)
    assert found.release  # loaded as --finetune: no optimizer, scheduler or RNG state, iteration 0 (upstream's rule)
    out = capsys.readouterr().out
    assert "release checkpoint" in out and "iteration 0" in out


@pytest.mark.parametrize("layout,needle", [
    (None, "release does not exist"),
    ("mp_rank_00/model_optim_rng.pt", "legacy format (--ckpt-format torch: 1 mp_rank_*/model_optim_rng.pt files"),
    ("something", "not a complete torch_dist checkpoint"),
])
def test_a_release_tracker_without_a_readable_release_folder_is_refused(tmp_path, layout, needle):
    (tmp_path / TRACKER).write_text("release")
    if layout:
        path = tmp_path / "release" / layout
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    with pytest.raises(CheckpointError) as e:
        resolve_load_dir(args_for(tmp_path))
    assert needle in str(e.value) and "iteration 0" not in str(e.value).split(";")[0]


def test_read_tracker_never_calls_release_iteration_0(tmp_path):
    (tmp_path / TRACKER).write_text("release")
    with pytest.raises(CheckpointError, match="release checkpoint"):
        read_tracker(str(tmp_path))


# ------------------------------------------------------------------------------ real jobs
STATIC = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4"]
DCP = STATIC + ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]


def digest(root):
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            h.update(os.path.relpath(os.path.join(d, name), root).encode())
            h.update(open(os.path.join(d, name), "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def saved(text_corpus, tmp_path_factory):
    """Per kind: (checkpoint folder at iteration 2, flags, the fresh run's loss records)."""
    root = tmp_path_factory.mktemp("tracker_cases")
    out = {}
    for kind, model in (("static", STATIC), ("dcp", DCP)):
        flags = model + ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
        save, log = str(root / kind), str(root / f"{kind}.jsonl")
        r = run_ranks(1, flags + ["--train-iters", "2", "--save", save, "--save-interval", "2", "--loss-log", log])
        assert r.returncode == 0, r.stderr[-3000:]
        out[kind] = (save, flags, read_loss_log(log))
    return out


@pytest.mark.dist
def test_a_lost_tracker_is_refused_and_nothing_overwritten(saved, tmp_path):
    source, flags, _ = saved["static"]
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(source, ckpt)
    os.remove(os.path.join(ckpt, TRACKER))
    before = digest(ckpt)
    log = str(tmp_path / "loss.jsonl")
    r = run_ranks(1, flags + ["--train-iters", "4", "--save", ckpt, "--load", ckpt, "--save-interval", "2",
                              "--loss-log", log])
    assert_one_line_error(r, f"{TRACKER} is missing but {ckpt} holds checkpoints (newest complete: iter_0000002)")
    assert "starting from scratch" not in r.stdout
    assert not os.path.exists(log)
    assert digest(ckpt) == before


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["static", "dcp"])
def test_a_release_checkpoint_loads_its_weights_from_iteration_0(saved, tmp_path, kind):
    source, flags, fresh = saved[kind]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(os.path.join(source, "iter_0000002"), ckpt / "release")
    (ckpt / TRACKER).write_text("release")
    log = str(tmp_path / "loss.jsonl")
    r = run_ranks(1, flags + ["--train-iters", "2", "--load", str(ckpt), "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "release checkpoint" in r.stdout and str(ckpt / "release") in r.stdout
    got = read_loss_log(log)
    assert [x["iteration"] for x in got] == [1, 2]  # the iteration count starts afresh
    assert got[0]["lm loss"] < fresh[0]["lm loss"]  # from the trained weights, not a fresh model's

"""A checkpoint saved before the format and keys were renamed still resumes (issue 39, item 5).

Why it exists: our checkpoints were `dcp-fixed-sharding/v1` with `dcp.<kind>.<name>` keys, a
name that clashed with PyTorch's DCP; they are now `adaptive-canonical/v1` with
`adaptive.<kind>.<name>`. Users hold checkpoints of the old names. The fixture
(tests/fixtures/checkpoint_before_rename) was written by the code before the rename; resuming it
must continue the run it came from: the losses of iterations 3 and 4 equal the unbroken run's.
The export tools read it too.
"""
import json
import os
import shutil

import pytest

from tests.support.fixture_corpus import write_fixture_corpus
from tests.support.helpers import read_loss_log, run_ranks, run_tool

pytestmark = pytest.mark.dist

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "checkpoint_before_rename")


@pytest.fixture
def old(tmp_path):
    """A copy of the fixture (a run may write beside the checkpoint: locks, caches) with the
    corpus it was trained on, built again (tests/support/fixture_corpus.py)."""
    shutil.copytree(FIXTURE, tmp_path / "old")
    write_fixture_corpus(str(tmp_path / "old"))
    with open(tmp_path / "old" / "reference.json") as f:
        return str(tmp_path / "old"), json.load(f)


def names_of(folder: str) -> tuple[str, list[str]]:
    """A saved iteration's format (common.pt) and tensor keys (torch_dist's metadata)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    return common["format"], list(FileSystemReader(folder).read_metadata().state_dict_metadata)


def test_the_fixture_is_of_the_old_names(old):
    path, _ = old
    form, keys = names_of(os.path.join(path, "checkpoint", "iter_0000002"))
    assert form == "dcp-fixed-sharding/v1"
    assert any(k.startswith("dcp.param.") for k in keys), keys[:5]
    assert not any(k.startswith("adaptive.") for k in keys), keys[:5]


def test_a_checkpoint_of_the_old_names_resumes_where_its_run_left_off(old, tmp_path):
    path, ref = old
    log = str(tmp_path / "resumed.jsonl")
    r = run_ranks(1, ref["flags"] + ["--data-path", os.path.join(path, "corpus_text_document"),
                                      "--data-cache-path", str(tmp_path / "cache"), "--loss-log", log,
                                      "--load", os.path.join(path, "checkpoint"), "--save", str(tmp_path / "new")])
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = read_loss_log(log)
    assert [x["iteration"] for x in resumed] == [3, 4]
    for x in resumed:
        assert x["lm loss"] == pytest.approx(ref["lm_loss"][str(x["iteration"])], rel=1e-5), x
    # what it saves is of the new names
    form, keys = names_of(str(tmp_path / "new" / "iter_0000004"))
    assert form == "adaptive-canonical/v1"
    assert any(k.startswith("adaptive.exp_avg.") for k in keys) and not any(k.startswith("dcp.") for k in keys)


def _without_dcp(flags: list[str]) -> list[str]:
    """The static path's flags: the run's flags less --dcp and the --dcp-* flags with their values."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "--dcp":
            continue
        elif f.startswith("--dcp-"):
            skip = True
        else:
            out.append(f)
    return out


def test_the_export_tool_reads_a_checkpoint_of_the_old_names(old, tmp_path):
    path, _ = old
    out = str(tmp_path / "exported")
    r = run_tool("tools/convert_dcp_checkpoint.py", ["--load", os.path.join(path, "checkpoint"), "--save", out])
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "2"


def test_the_static_path_knows_a_checkpoint_of_the_old_names_as_adaptive(old, tmp_path):
    """Not misread as a static checkpoint: the static path says what it is and how to start from it."""
    path, ref = old
    flags = _without_dcp(ref["flags"]) + ["--micro-batch-size", "1", "--global-batch-size", "2",
                                          "--data-path", os.path.join(path, "corpus_text_document"),
                                          "--data-cache-path", str(tmp_path / "cache"),
                                          "--load", os.path.join(path, "checkpoint")]
    r = run_ranks(1, flags)
    assert r.returncode != 0
    assert "an adaptive-runtime checkpoint (saved with --dcp)" in r.stderr, r.stderr[-2000:]
    r = run_ranks(1, flags + ["--finetune"])
    assert r.returncode == 0, r.stderr[-3000:]

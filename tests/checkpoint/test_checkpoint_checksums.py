"""Corruption is caught before it is trained on (issue 37, class B): every save records the
size and sha256 of each file of the checkpoint (checksums.json, written before the folder is
committed), and every load checks them before any of it is used, on both paths.

64 bytes flipped inside a shard (size unchanged) used to load with exit code 0 and train on.
Now: one line naming the file and the checkpoint to fall back to, before the first
iteration; `--no-verify-checkpoint` skips the check with a line; a checkpoint without
checksums (ours from before, upstream's) loads with a line saying it is unverified.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.support import checkpoint_payloads as payloads
from tests.conftest import TINY_MODEL
from tests.support.helpers import read_loss_log, run_ranks
from tests.support.helpers import assert_one_line_error

STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4"]
DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]
PATHS = {"static": STATIC, "dcp": DCP}
DIFFERS = "is damaged: its sha256 differs from the one recorded when it was saved"


# ------------------------------------------------------------------ in this process
def _folder(root, iteration, files):
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return folder


def test_written_table_checks_and_names_the_fallback(tmp_path, capsys):
    from megatron.training.checkpoint.checksums import CHECKSUM_FILE, write_checksums
    from megatron.training.checkpoint.inspector import verify_checkpoint
    from megatron.training.checkpoint.protocol import CheckpointError

    files = {"__0_0.distcp": bytes(range(256)) * 64, "__1_0.distcp": b"\1" * 1000, "common.pt": b"common"}
    for n in (1, 2):
        write_checksums(str(_folder(tmp_path, n, files)))
    table = json.loads((tmp_path / "iter_0000002" / CHECKSUM_FILE).read_text())
    assert sorted(table["files"]) == sorted(list(files) + ["metadata.json"])
    assert table["files"]["__1_0.distcp"]["bytes"] == 1000
    folder = str(tmp_path / "iter_0000002")
    verify_checkpoint(folder)  # intact
    payloads.flip(os.path.join(folder, "__0_0.distcp"))
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(folder)
    line = str(e.value)
    assert line.startswith(f"{folder}/__0_0.distcp {DIFFERS}"), line
    assert f"fall back to the previous complete checkpoint, iteration 1 ({tmp_path}/iter_0000001)" in line, line
    assert f"echo 1 > {tmp_path}/latest_checkpointed_iteration.txt" in line, line
    payloads.flip(str(tmp_path / "iter_0000001" / "common.pt"), count=2, at=0)
    with pytest.raises(CheckpointError, match="common.pt is damaged.*no earlier complete checkpoint next to it"):
        verify_checkpoint(str(tmp_path / "iter_0000001"))
    capsys.readouterr()
    verify_checkpoint(folder, skip=True)
    assert "--no-verify-checkpoint: the files of" in capsys.readouterr().out


def test_a_file_missing_resized_or_a_damaged_table_is_one_line(tmp_path, capsys):
    from megatron.training.checkpoint.checksums import CHECKSUM_FILE, write_checksums
    from megatron.training.checkpoint.inspector import verify_checkpoint
    from megatron.training.checkpoint.protocol import CheckpointError

    folder = _folder(tmp_path, 3, {"__0_0.distcp": b"x" * 100, "common.pt": b"c"})
    write_checksums(str(folder))
    (folder / "__0_0.distcp").write_bytes(b"x" * 99)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is damaged: it is 99 bytes, 100 when it was saved"):
        verify_checkpoint(str(folder))
    os.remove(folder / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=rf"__0_0.distcp is missing \({CHECKSUM_FILE} lists it\)"):
        verify_checkpoint(str(folder))
    (folder / CHECKSUM_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{CHECKSUM_FILE} is damaged"):
        verify_checkpoint(str(folder))
    os.remove(folder / CHECKSUM_FILE)
    capsys.readouterr()
    verify_checkpoint(str(folder))
    said = capsys.readouterr().out
    assert f"has no {CHECKSUM_FILE}" in said and "loaded unverified" in said, said


def test_save_writes_the_table_before_the_commit():
    """In the save protocol the table is written after the shards and before anything that
    can make the folder a complete, named checkpoint (the fsync of the staging folder, its
    rename, the tracker)."""
    import inspect

    from megatron.training.checkpoint import protocol as checkpoint_protocol

    src = inspect.getsource(checkpoint_protocol.save_sharded_atomic)
    order = [src.index(s) for s in ("dist_checkpointing.save(", "write_checksums(staging)", "_fsync_tree(staging)",
                                    '_fault_point("after_shards")', "os.rename(staging, final)", "_commit_tracker(")]
    assert order == sorted(order), order


# ------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def checkpoints(text_corpus, tmp_path_factory):
    """A static and a --dcp checkpoint of the tiny model (1 rank, iterations 1 and 2), and the
    losses of iteration 3 resumed from each, clean."""
    root = tmp_path_factory.mktemp("checksum_ckpt")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    out = {"data": data}
    for kind, flags in PATHS.items():
        save = str(root / kind)
        r = run_ranks(1, TINY_MODEL + data + flags + ["--train-iters", "2", "--save-interval", "1", "--save", save])
        assert r.returncode == 0, r.stderr[-3000:]
        out[kind] = save
    return out


def _resume(checkpoints, kind, root, log, *flags):
    return run_ranks(1, TINY_MODEL + checkpoints["data"] + PATHS[kind] + ["--train-iters", "3", "--load", root,
                                                                          "--loss-log", log, *flags])


@pytest.mark.dist
def test_every_file_of_a_save_is_in_its_table(checkpoints):
    from megatron.training.checkpoint.checksums import CHECKSUM_FILE, file_digest

    for kind in PATHS:
        folder = payloads.iteration_dir(checkpoints[kind])
        table = json.load(open(os.path.join(folder, CHECKSUM_FILE)))["files"]
        on_disk = sorted(n for n in os.listdir(folder) if n != CHECKSUM_FILE)
        assert sorted(table) == on_disk and any(n.endswith(".distcp") for n in on_disk), (kind, table)
        for name, want in table.items():
            assert file_digest(os.path.join(folder, name)) == want["sha256"], (kind, name)


@pytest.mark.dist
@pytest.mark.parametrize("kind,shard", [("static", "__0_0.distcp"), ("static", "__0_1.distcp"),
                                        ("dcp", "__0_0.distcp")])
def test_flipped_bytes_in_a_shard_are_refused_before_training(checkpoints, tmp_path, kind, shard):
    root = str(tmp_path / "ck")
    folder = payloads.copy(checkpoints[kind], root)
    size = os.path.getsize(os.path.join(folder, shard))
    payloads.flip(os.path.join(folder, shard))
    assert os.path.getsize(os.path.join(folder, shard)) == size
    log = str(tmp_path / "loss.jsonl")
    r = _resume(checkpoints, kind, root, log)
    assert_one_line_error(r, f"{folder}/{shard} {DIFFERS}; fall back to the previous complete checkpoint, iteration 1")
    assert r.returncode == 1
    assert not os.path.exists(log) or read_loss_log(log) == [], "it trained on the damaged checkpoint"
    # a store the user trusts: the check is skipped, said in one line, and it trains
    r = _resume(checkpoints, kind, root, log, "--no-verify-checkpoint")
    assert "--no-verify-checkpoint: the files of" in r.stdout, r.stdout[-2000:]


@pytest.mark.dist
@pytest.mark.parametrize("kind", list(PATHS))
def test_a_checkpoint_without_checksums_loads_with_a_line(checkpoints, tmp_path, kind):
    root = str(tmp_path / "ck")
    folder = payloads.copy(checkpoints[kind], root)
    os.remove(os.path.join(folder, "checksums.json"))
    log = str(tmp_path / "loss.jsonl")
    r = _resume(checkpoints, kind, root, log)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "has no checksums.json" in r.stdout and "loaded unverified" in r.stdout, r.stdout[-2000:]
    assert [x["iteration"] for x in read_loss_log(log)] == [3]


@pytest.mark.dist
def test_ranks_share_the_check_and_agree(text_corpus, tmp_path):
    """2 ranks (tensor parallel): each hashes its own shards at save and about half the bytes
    at load; a file only rank 1 checks stops both ranks with the same line."""
    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    flags = TINY_MODEL + data + STATIC + ["--tensor-model-parallel-size", "2"]
    save = str(tmp_path / "tp2")
    r = run_ranks(2, flags + ["--train-iters", "1", "--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    folder = payloads.iteration_dir(save)
    table = json.load(open(os.path.join(folder, "checksums.json")))["files"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(table), table
    from megatron.training.checkpoint.checksums import shares

    rank1 = shares(table, 2)[1][0]
    payloads.flip(os.path.join(folder, rank1), at=0.9)
    r = run_ranks(2, flags + ["--train-iters", "2", "--load", save])
    assert r.returncode != 0
    said = re.findall(r"error: (\S+) is damaged: its sha256 differs", r.stderr)  # each rank's line
    assert said == [f"{folder}/{rank1}"] * 2, r.stderr[-3000:]
    shutil.rmtree(save)

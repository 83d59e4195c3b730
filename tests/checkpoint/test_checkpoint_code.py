"""No code runs from a checkpoint (issue 37, class A): every pickled file of a checkpoint is
read as data only, under `--load` on both paths and by every tool.

A payload (tests/support/checkpoint_payloads.py) creates a marker file when unpickled and then
returns the real content, so a loader that runs it carries on as if nothing happened. It is
put in the shard index (`.metadata`, which torch read with plain pickle.load), in an object
stored inside a shard (the static path's RNG state, which torch read with
weights_only=False) and in `common.pt`; the checksum table is rewritten after each change,
as an attacker who can write the files would. Each must end in one `error:` line naming the
file and saying it was refused because it would run code, a non-zero exit, and no marker.
"""
from __future__ import annotations

import os
import pickle

import pytest

from tests.support import checkpoint_payloads as payloads
from tests.conftest import TINY_MODEL
from tests.support.helpers import free_port, run_ranks, run_tool
from tests.support.helpers import assert_one_line_error

REFUSED = "refused: reading it would run code"
STATIC = ["--micro-batch-size", "2", "--global-batch-size", "4"]
DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off"]
PATHS = {"static": STATIC, "dcp": DCP}


# ------------------------------------------------------------------ in this process
def _torch_checkpoint(folder, **extra):
    """A small torch_dist-style folder (torch.distributed.checkpoint, no process group)."""
    import json
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).reshape(2, 3), **extra}, checkpoint_id=str(folder), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"iteration": 1}, folder / "common.pt")
    return folder


def test_index_with_code_is_refused_by_the_inspector(tmp_path):
    from megatron.training.checkpoint.inspector import inspect_checkpoint
    from megatron.training.checkpoint.protocol import CheckpointError

    folder = _torch_checkpoint(tmp_path / "ck")
    inspect_checkpoint(str(folder))  # the real index reads
    marker = tmp_path / "ran"
    payloads.poison_index(str(folder), str(marker))
    with pytest.raises(CheckpointError) as e:
        inspect_checkpoint(str(folder))
    assert not marker.exists(), "the index's code ran"
    assert str(e.value).startswith(f"{folder}/.metadata: {REFUSED} (it names builtins.eval"), e.value


def test_index_reader_takes_the_types_an_index_holds_only(tmp_path):
    """torch's own reader, as megatron-core and the tools call it, reads through the allow-list."""
    from torch.distributed.checkpoint import FileSystemReader

    from dcp_ext.compat import mcore_compat
    from dcp_ext.compat.checkpoint_unpickler import CodeRefused

    mcore_compat.read_checkpoints_as_data_only()
    folder = _torch_checkpoint(tmp_path / "ck")
    index = FileSystemReader(str(folder)).read_metadata()
    assert set(index.state_dict_metadata) == {"w"} and index.storage_meta.load_id is not None
    for module, name in (("os", "system"), ("posix", "system"), ("builtins", "getattr"), ("subprocess", "Popen"),
                         ("torch", "load"), ("torch.serialization", "load")):
        (folder / ".metadata").write_bytes(b"\x80\x04c" + f"{module}\n{name}\n".encode() + b")R.")
        with pytest.raises(CodeRefused, match=f"it names {module}.{name}"):
            FileSystemReader(str(folder)).read_metadata()
    (folder / ".metadata").write_bytes(pickle.dumps({"not": "an index"}))
    with pytest.raises(pickle.UnpicklingError, match="not a checkpoint index"):
        FileSystemReader(str(folder)).read_metadata()


def test_object_inside_a_shard_with_code_is_refused(tmp_path):
    """torch's load planner read stored objects with weights_only=False."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_ext.compat import mcore_compat
    from dcp_ext.compat.checkpoint_unpickler import CodeRefused

    mcore_compat.read_checkpoints_as_data_only()
    folder = _torch_checkpoint(tmp_path / "ck", obj="the real object")
    marker = tmp_path / "ran"
    key = payloads.poison_stored_object(str(folder), str(marker))
    assert key == "obj"
    state = {"w": torch.zeros(2, 3), "obj": ""}
    with warnings.catch_warnings(), pytest.raises(BaseException) as e:  # torch: CheckpointException
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    from megatron.training.startup.os_errors import exception_chain

    refused = [x for x in exception_chain(e.value) if isinstance(x, CodeRefused)]
    assert not marker.exists(), "the stored object's code ran"
    assert refused and str(refused[0]).startswith(f"__0_0.distcp: obj: {REFUSED}"), e.value


def test_common_state_with_code_is_refused_whatever_the_environment(tmp_path, monkeypatch):
    """common.pt is read with weights_only=True even where TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
    turns torch.load's default off."""
    from megatron.training.checkpoint.inspector import load_common_or_explain
    from megatron.training.checkpoint.protocol import CheckpointError

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    folder = _torch_checkpoint(tmp_path / "ck")
    marker = tmp_path / "ran"
    payloads.poison_common(str(folder), str(marker))
    with pytest.raises(CheckpointError) as e:
        load_common_or_explain(str(folder))
    assert not marker.exists(), "common.pt's code ran"
    assert str(e.value).startswith(f"{folder}/common.pt: {REFUSED} (it names builtins.eval"), e.value


def test_refusal_crosses_ranks_intact():
    """torch gathers a rank's failure to the others by pickling it."""
    from dcp_ext.compat.checkpoint_unpickler import CodeRefused

    e = pickle.loads(pickle.dumps(CodeRefused("/ck/.metadata", "posix.system")))
    assert isinstance(e, CodeRefused) and str(e).startswith(f"/ck/.metadata: {REFUSED} (it names posix.system")


# ------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def checkpoints(text_corpus, tmp_path_factory):
    """A static and a --dcp checkpoint of the tiny model (1 rank, iteration 2)."""
    root = tmp_path_factory.mktemp("code_ckpt")
    data = ["--data-path", text_corpus, "--data-cache-path", str(root / "cache")]
    out = {"data": data}
    for kind, flags in PATHS.items():
        save = str(root / kind)
        r = run_ranks(1, TINY_MODEL + data + flags + ["--train-iters", "2", "--save", save])
        assert r.returncode == 0, r.stderr[-3000:]
        out[kind] = save
    return out


def _poisoned(checkpoints, kind, where, tmp_path):
    root = str(tmp_path / f"{kind}_{where}")
    folder = payloads.copy(checkpoints[kind], root)
    marker = str(tmp_path / "ran")
    {"index": payloads.poison_index, "common": payloads.poison_common,
     "object": payloads.poison_stored_object}[where](folder, marker)
    payloads.reseal(folder)
    return root, folder, marker


@pytest.mark.dist
@pytest.mark.parametrize("kind,where,file", [("static", "index", ".metadata"), ("dcp", "index", ".metadata"),
                                             ("static", "object", "__0_"), ("dcp", "common", "common.pt")])
def test_load_never_runs_a_payload(checkpoints, tmp_path, kind, where, file):
    root, folder, marker = _poisoned(checkpoints, kind, where, tmp_path)
    r = run_ranks(1, TINY_MODEL + checkpoints["data"] + PATHS[kind] + ["--train-iters", "3", "--load", root],
                  env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert not os.path.exists(marker), f"--load ran the {where}'s code ({kind}): rc {r.returncode}"
    assert_one_line_error(r, f"{folder}/{file}")
    assert REFUSED in r.stderr


def _convert(load, save):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    return run_tool("tools/convert_dcp_checkpoint.py", ["--load", load, "--save", save], env=env, timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("tool,kind", [("convert", "dcp"), ("hf-export", "static"), ("hf-export", "dcp")])
def test_tools_never_run_a_payload(checkpoints, tmp_path, tool, kind):
    root, folder, marker = _poisoned(checkpoints, kind, "index", tmp_path)
    out = str(tmp_path / "out")
    if tool == "convert":
        r = _convert(root, out)
    else:
        r = run_tool("tools/checkpoint_hf.py", ["export", "--load", root, "--hf", out], timeout=300)
    assert not os.path.exists(marker), f"{tool} ran the index's code: rc {r.returncode}"
    assert_one_line_error(r, f"{folder}/.metadata: {REFUSED}")

"""tools/convert_dcp_checkpoint.py never damages a checkpoint: not the source, not what `--save`
already holds, not when it is killed halfway.

- `--save` pointing at a directory that holds a checkpoint (a tracker, or `iter_*` folders) is
  refused in one line unless `--force`; with `--force` an export older than the tracker is still
  refused (it would rewind the tracker: 6 -> 3 loses the user's newer checkpoint).
- Fault injection: the converter is killed (`DCP_FAULT_INJECT=<step>`, os._exit as a kill -9
  would, at each step of megatron/training/checkpoint/protocol.py's save) while exporting over
  an older export (tracker 2 -> 3) and over the same iteration (3 -> 3). Before the save's
  commit step the destination's tracker is unchanged and names its previous checkpoint, which
  loads with the same tensors; from the commit on it names the new export, which loads. Either
  way the source is byte for byte what it was, and a next `--force` export succeeds and
  leaves no leftovers.

The conversions run in the session's fork server with the environment torchrun gives one rank
(RANK=0, WORLD_SIZE=1): the converter works in that process, so a fault kills the converter
itself (exit 17). Two rows use the converter's own spawned rank instead (no RANK), where the
dying rank is reported in one line that says what the destination holds now.
"""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import free_port, run_ranks, run_tool
from tests.support.helpers import assert_one_line_error

TOOL = "tools/convert_dcp_checkpoint.py"
TRACKER = "latest_checkpointed_iteration.txt"
FAULT_EXIT = 17  # checkpoint_protocol._fault_point's os._exit code
LEFTOVERS = (".incomplete", ".old", ".deleting", ".tmp")


def convert(*flags, fault: str | None = None, spawned: bool = False):
    env = {} if spawned else {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port())}
    if fault:
        env["DCP_FAULT_INJECT"] = fault
    return run_tool(TOOL, list(flags), env=env, timeout=300)


def digest(root: str) -> str:
    """Every file's relative path and bytes under `root`."""
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(d, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def tracker(root: str):
    path = os.path.join(root, TRACKER)
    return open(path).read().strip() if os.path.exists(path) else None


def tensors(path: str, tmp: str) -> dict:
    """Every tensor of a torch_dist checkpoint directory, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tmp, "plain.pt")
    dcp_to_torch_save(path, out)
    loaded = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def source(text_corpus, tmp_path_factory):
    """A --dcp checkpoint with iterations 2 and 3 (tracker 3), and exports of each made with
    no fault: `older` holds iteration 2, `same` iteration 3."""
    root = tmp_path_factory.mktemp("convert_faults")
    dcp = str(root / "dcp")
    r = run_ranks(1, TINY_MODEL + ["--data-path", text_corpus, "--data-cache-path", str(root / "cache"), "--dcp",
                                   "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off",
                                   "--train-iters", "3", "--save-interval", "2", "--save", dcp])
    assert r.returncode == 0, r.stderr[-3000:]
    assert tracker(dcp) == "3" and os.path.isdir(os.path.join(dcp, "iter_0000002")), os.listdir(dcp)
    exports = {}
    for name, iteration in (("older", 2), ("same", 3)):
        out = str(root / name)
        r = convert("--load", dcp, "--save", out, "--iteration", str(iteration))
        assert r.returncode == 0, r.stderr[-3000:]
        exports[name] = out
    return dcp, digest(dcp), exports


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ------------------------------------------------------------------ refusals
def _training_ckpt_at_6(dcp, tmp):
    """A user's training checkpoint whose tracker names 6 (the source's iteration 3 renamed)."""
    dest = _copy(dcp, str(tmp / "user"))
    os.rename(os.path.join(dest, "iter_0000003"), os.path.join(dest, "iter_0000006"))
    with open(os.path.join(dest, TRACKER), "w") as f:
        f.write("6")
    return dest


def _iter_folders_only(exports, tmp):
    dest = _copy(exports["same"], str(tmp / "no_tracker"))
    os.remove(os.path.join(dest, TRACKER))
    return dest


def _garbage_tracker(exports, tmp):
    dest = _copy(exports["same"], str(tmp / "garbage"))
    with open(os.path.join(dest, TRACKER), "w") as f:
        f.write("soon")
    return dest


REFUSALS = [  # (id, make the destination, flags after --load/--save, exit code, needle)
    ("holds-a-checkpoint", lambda dcp, ex, tmp: _copy(ex["same"], str(tmp / "d")), ["--iteration", "2"], 2,
     "already holds a checkpoint (its tracker names iteration 3)"),
    ("holds-a-training-checkpoint", lambda dcp, ex, tmp: _training_ckpt_at_6(dcp, tmp), [], 2,
     "already holds a checkpoint (its tracker names iteration 6)"),
    ("holds-iter-folders", lambda dcp, ex, tmp: _iter_folders_only(ex, tmp), [], 2,
     "already holds a checkpoint (iter_0000003)"),
    ("force-would-rewind", lambda dcp, ex, tmp: _copy(ex["same"], str(tmp / "d")), ["--iteration", "2", "--force"],
     2, "would rewind its tracker from iteration 3 to 2"),
    ("force-would-rewind-training", lambda dcp, ex, tmp: _training_ckpt_at_6(dcp, tmp), ["--force"], 2,
     "would rewind its tracker from iteration 6 to 3"),
    ("force-unreadable-tracker", lambda dcp, ex, tmp: _garbage_tracker(ex, tmp), ["--force"], 1,
     "expected an iteration number, found 'soon'"),
    ("save-is-a-file", lambda dcp, ex, tmp: str(tmp / "afile"), [], 1, "afile: is a file, not a directory"),
    ("save-inside-load", lambda dcp, ex, tmp: os.path.join(dcp, "export"), [], 2, "is inside --load"),
    ("save-links-to-load", lambda dcp, ex, tmp: _link(dcp, tmp), [], 2, "--save must differ from --load"),
]


def _link(dcp, tmp):
    os.symlink(dcp, str(tmp / "link"))
    return str(tmp / "link")


@pytest.mark.dist
@pytest.mark.parametrize("make,flags,code,needle", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_change_nothing(source, tmp_path, make, flags, code, needle):
    dcp, dcp_digest, exports = source
    (tmp_path / "afile").write_text("not a directory\n")
    dest = make(dcp, exports, tmp_path)
    before = digest(dest) if os.path.isdir(dest) else None
    r = convert("--load", dcp, "--save", dest, *flags)
    assert_one_line_error(r, needle)
    assert r.returncode == code, r.stderr
    assert digest(dcp) == dcp_digest, "the source checkpoint changed"
    if before is not None and os.path.realpath(dest) != os.path.realpath(dcp):
        assert digest(dest) == before, "the refused destination changed"


@pytest.mark.dist
def test_load_with_an_unreadable_tracker_is_one_line(source, tmp_path):
    dcp, _, _ = source
    load = _copy(dcp, str(tmp_path / "src"))
    with open(os.path.join(load, TRACKER), "w") as f:
        f.write("soon")
    r = convert("--load", load, "--save", str(tmp_path / "out"))
    assert_one_line_error(r, "expected an iteration number, found 'soon'")
    assert r.returncode == 1 and not os.path.exists(tmp_path / "out")


@pytest.mark.dist
def test_force_moves_the_tracker_forward_only(source, tmp_path):
    dcp, dcp_digest, exports = source
    dest = _copy(exports["older"], str(tmp_path / "d"))
    r = convert("--load", dcp, "--save", dest, "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    assert tracker(dest) == "3" and sorted(os.listdir(dest)) == ["iter_0000002", "iter_0000003", TRACKER]
    r = convert("--load", dcp, "--save", dest, "--force")  # the same iteration again: allowed with --force
    assert r.returncode == 0, r.stderr[-3000:]
    assert tracker(dest) == "3" and digest(dcp) == dcp_digest


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    """In this process (nothing started): a Ctrl-C while the converter reads its source."""
    import importlib.util

    for name in ("CUDA_VISIBLE_DEVICES", "PYTHONWARNINGS"):  # main() sets both; put them back after
        monkeypatch.setenv(name, os.environ.get(name, ""))
    spec = importlib.util.spec_from_file_location("convert_dcp_checkpoint", os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), TOOL))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "resolve_source", interrupt)
    try:
        code = tool.main(["--load", "a", "--save", "b"])
    except KeyboardInterrupt:
        code = "KeyboardInterrupt escaped"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 130, code
    assert len(err) == 1 and err[0].startswith("error: interrupted (Ctrl-C)"), err


# ------------------------------------------------------------------ fault injection
def _fault_cases():
    from megatron.training.checkpoint.protocol import FAULT_POINTS

    resave_only = ("after_aside", "after_mark_delete", "mid_delete_old", "after_delete_old")
    for scenario in ("older", "same"):
        for point in FAULT_POINTS:
            if scenario == "older" and point in resave_only:
                continue
            yield pytest.param(scenario, point, id=f"{scenario}-{point}")


# the save's commit step: the tracker names a new iteration / the re-export renamed into place
COMMIT = {"older": "after_tracker", "same": "after_rename"}
PREVIOUS = {"older": "2", "same": "3"}


def _assert_loads(dest: str, iteration: str, tmp: str, same_as: dict | None) -> None:
    """The tracker names `iteration`, the directory the loader would read is complete, and its
    tensors load (equal to `same_as`'s where given)."""
    import torch

    from megatron.training.checkpoint.protocol import find_checkpoint

    assert tracker(dest) == iteration, sorted(os.listdir(dest))
    path = find_checkpoint(dest, int(iteration))
    assert path is not None, f"no complete checkpoint of iteration {iteration}: {sorted(os.listdir(dest))}"
    got = tensors(path, tmp)
    assert got and "embedding.word_embeddings.weight" in got, sorted(got)
    if same_as is not None:
        assert sorted(got) == sorted(same_as)
        assert all(torch.equal(got[k], same_as[k]) for k in got), "the previous checkpoint's tensors changed"


@pytest.fixture(scope="module")
def previous_tensors(source, tmp_path_factory):
    _, _, exports = source
    tmp = str(tmp_path_factory.mktemp("tensors"))
    return {name: tensors(os.path.join(path, f"iter_000000{PREVIOUS[name]}"), tmp) for name, path in exports.items()}


@pytest.mark.dist
@pytest.mark.parametrize("scenario,point", list(_fault_cases()))
def test_export_killed_at_each_step(source, previous_tensors, tmp_path, scenario, point):
    from megatron.training.checkpoint.protocol import FAULT_POINTS

    dcp, dcp_digest, exports = source
    dest = _copy(exports[scenario], str(tmp_path / "dest"))
    r = convert("--load", dcp, "--save", dest, "--force", fault=point)
    assert r.returncode == FAULT_EXIT, f"the export did not reach {point} (exit {r.returncode}):\n{r.stderr[-3000:]}"
    assert digest(dcp) == dcp_digest, "the source checkpoint changed"
    if FAULT_POINTS.index(point) < FAULT_POINTS.index(COMMIT[scenario]):
        _assert_loads(dest, PREVIOUS[scenario], str(tmp_path), previous_tensors[scenario])
    else:
        _assert_loads(dest, "3", str(tmp_path), None)
    # the next export tidies up what the crash left
    r = convert("--load", dcp, "--save", dest, "--force")
    assert r.returncode == 0, r.stderr[-3000:]
    assert tracker(dest) == "3"
    assert [n for n in os.listdir(dest) if n.endswith(LEFTOVERS)] == [], sorted(os.listdir(dest))


@pytest.mark.dist
@pytest.mark.parametrize("point,needle,holds", [
    ("after_shards", "its tracker still names iteration 2", "2"),
    ("after_tracker", "its tracker names the new export, iteration 3", "3"),
])
def test_a_dying_spawned_rank_says_what_save_holds(source, tmp_path, point, needle, holds):
    dcp, dcp_digest, exports = source
    dest = _copy(exports["older"], str(tmp_path / "dest"))
    r = convert("--load", dcp, "--save", dest, "--force", fault=point, spawned=True)
    assert_one_line_error(r, "rank 0 died (exit code 17)")
    assert needle in r.stderr, r.stderr
    assert tracker(dest) == holds and digest(dcp) == dcp_digest

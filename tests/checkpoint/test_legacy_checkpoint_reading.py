"""Reading upstream's legacy checkpoints (`--ckpt-format torch`), in one process: the rank files
as data only (a file that would run code is refused and nothing runs; Megatron's enums, the
args Namespace and numpy RNG arrays are data), the refusal of `--load` that names the format
and the conversion command, and the converter's joining of tensor-parallel shards.
The conversion end to end: tests/checkpoint/test_convert_legacy_checkpoint.py."""
import argparse

import pytest

from tests.support import checkpoint_payloads as payloads


def _legacy_dir(root, iteration=5, ranks=("mp_rank_00", "mp_rank_01"), tracker=None):
    folder = root / ("release" if tracker == "release" else f"iter_{iteration:07d}")
    for name in ranks:
        (folder / name).mkdir(parents=True)
        (folder / name / "model_optim_rng.pt").write_bytes(b"")
    if tracker is not False:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker or iteration))
    return folder


def test_load_of_a_legacy_checkpoint_names_its_format_and_the_conversion(tmp_path):
    from megatron.training.checkpoint.protocol import CheckpointError, resolve_load_dir

    root = tmp_path / "upstream"
    _legacy_dir(root)
    with pytest.raises(CheckpointError) as e:
        resolve_load_dir(str(root))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"--load {root}: {root}/iter_0000005 is an upstream Megatron-LM checkpoint in its legacy "
                           "format (--ckpt-format torch: 2 mp_rank_*/model_optim_rng.pt files, tensor-parallel 2, "
                           "pipeline-parallel 1)"), line
    assert (f"convert its weights with `python tools/convert_legacy_checkpoint.py --load {root} --save "
            f"{root}_torch_dist`, then train with --load {root}_torch_dist --finetune") in line
    assert "missing or incomplete" not in line


def test_legacy_release_and_trackerless_checkpoints_say_the_same(tmp_path):
    from megatron.training.checkpoint.protocol import CheckpointError, resolve_load_dir

    release = tmp_path / "release_ckpt"
    _legacy_dir(release, ranks=("mp_rank_00_000", "mp_rank_00_001"), tracker="release")
    with pytest.raises(CheckpointError, match=r"pipeline-parallel 2\); this fork loads torch_dist"):
        resolve_load_dir(str(release))
    bare = tmp_path / "no_tracker"
    _legacy_dir(bare, iteration=300, tracker=False)
    with pytest.raises(CheckpointError, match="add --iteration 300 to the conversion"):
        resolve_load_dir(str(bare))


def _upstream_like_file(path, **extra):
    import numpy as np
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(num_layers=2, attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
                              params_dtype=torch.bfloat16, **extra)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3,
                "model": {"embedding.word_embeddings.weight": torch.arange(6.0).reshape(3, 2)},
                "rng_state": [{"np_rng_state": np.random.get_state()}]}, path)


def test_rank_file_with_upstreams_types_reads_as_data(tmp_path):
    from dcp_ext.compat.checkpoint_unpickler import load_legacy_file

    path = str(tmp_path / "model_optim_rng.pt")
    _upstream_like_file(path)
    state = load_legacy_file(path)
    assert isinstance(state["args"], argparse.Namespace) and state["args"].num_layers == 2
    assert state["model"]["embedding.word_embeddings.weight"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_an_enum_this_megatron_lacks_is_an_inert_record(tmp_path, monkeypatch):
    """Another Megatron version's enum in args: read as a record, its class never imported."""
    import enum

    import megatron.core.transformer.enums as enums

    from dcp_ext.compat.checkpoint_unpickler import StoredRecord, load_legacy_file

    class FutureScope(enum.Enum):
        layer = 7

    FutureScope.__module__, FutureScope.__qualname__ = enums.__name__, "FutureScope"
    monkeypatch.setattr(enums, "FutureScope", FutureScope, raising=False)
    path = str(tmp_path / "model_optim_rng.pt")
    _upstream_like_file(path, cuda_graph_scope=FutureScope.layer)
    monkeypatch.delattr(enums, "FutureScope")  # this megatron-core does not have it
    state = load_legacy_file(path)
    scope = state["args"].cuda_graph_scope
    assert isinstance(scope, StoredRecord) and scope.name == f"{enums.__name__}.FutureScope" and scope.args == (7,)


def test_a_rank_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    import torch

    from tools.convert_legacy_checkpoint import ConversionError, read_rank_file

    real = tmp_path / "real.pt"
    _upstream_like_file(str(real))
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    with open(path, "wb") as f:
        f.write(payloads._torch_payload(str(marker), real.read_bytes()))
    with pytest.raises(ConversionError) as e:
        read_rank_file(str(path))
    assert not marker.exists(), "the file's code ran"
    assert str(e.value).startswith(f"{path}: refused: reading it would run code (it names builtins.eval"), e.value
    assert "\n" not in str(e.value)
    import shutil

    torch.save({"args": None, "f": shutil.rmtree}, path)  # a callable stored by reference
    with pytest.raises(ConversionError, match=r"it names shutil\.rmtree"):
        read_rank_file(str(path))


def test_tensor_parallel_shards_join_along_the_models_dimension():
    import torch

    from tools.convert_legacy_checkpoint import ConversionError, join_shards

    full = torch.arange(24.0).reshape(6, 4)
    # column-parallel (rows) and row-parallel (columns); a replicated norm
    assert torch.equal(join_shards("w", list(full.chunk(2, 0)), (6, 4), gated=True), full)
    assert torch.equal(join_shards("w", list(full.chunk(2, 1)), (6, 4), gated=False), full)
    norm = torch.ones(4)
    assert join_shards("decoder.final_layernorm.weight", [norm, norm], (4,), gated=False) is norm
    # SwiGLU's fc1: each rank holds [gate_r; up_r]; the full layer is [gates; ups]
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]
    joined = join_shards("decoder.layers.0.mlp.linear_fc1.weight", shards, (8, 2), gated=True)
    assert torch.equal(joined, torch.cat([gate, up]))
    with pytest.raises(ConversionError, match=r"2 shards of shape \(3, 4\) do not make the model's \(5, 4\)"):
        join_shards("w", list(full.chunk(2, 0)), (5, 4), gated=False)


def test_converter_refuses_what_it_cannot_convert(tmp_path):
    from tools.convert_legacy_checkpoint import ConversionError, model_chunks, rank_files, resolve_source

    grid = _legacy_dir(tmp_path / "a", ranks=("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001"))
    with pytest.raises(ConversionError, match=r"mp_rank_01_001 is missing \(the checkpoint has tensor-parallel 2"):
        rank_files(str(grid))
    moe = _legacy_dir(tmp_path / "b", ranks=("mp_rank_00_000_000", "mp_rank_00_000_001"))
    with pytest.raises(ConversionError, match="a mixture-of-experts checkpoint"):
        rank_files(str(moe))
    with pytest.raises(ConversionError, match="pass its parent"):
        resolve_source(str(grid), None)
    with pytest.raises(ConversionError, match="no latest_checkpointed_iteration.txt found; name the checkpoint "
                                              "with --iteration N"):
        resolve_source(str(tmp_path), None)
    with pytest.raises(ConversionError, match="pre-core GPT model"):
        model_chunks({"model": {"language_model": {}}}, "f.pt")
    assert model_chunks({"model1": {"b": 2}, "model0": {"a": 1}}, "f.pt") == [{"a": 1}, {"b": 2}]

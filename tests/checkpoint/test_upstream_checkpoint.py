"""A checkpoint laid out as upstream Megatron-LM writes it resumes on the static path: the
iteration count, the consumed samples and the distributed optimizer's `dp_reshardable` state
(the next iterations' losses equal an uninterrupted run's, bit for bit); ours record what
upstream's loader reads (`args.consumed_train_samples`, `content_metadata`)."""
import os
from types import SimpleNamespace

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, read_loss_log, run_ranks

COMMON = TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                       "--use-distributed-optimizer"]
UPSTREAM_ENTRY = os.path.join(REPO, "tests", "support", "upstream_save_entry.py")


@pytest.mark.dist
def test_upstream_checkpoint_resumes_with_its_optimizer_state(text_corpus, tmp_path):
    import torch

    data = ["--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")]
    save, full_log = str(tmp_path / "upstream"), str(tmp_path / "full.jsonl")
    # 4 iterations, saving upstream's way at 2 (and 4): the reference of the resumed run
    r = run_ranks(1, COMMON + data + ["--save", save, "--save-interval", "2", "--loss-log", full_log],
                  entry=UPSTREAM_ENTRY)
    assert r.returncode == 0, r.stderr[-3000:]
    common = torch.load(os.path.join(save, "iter_0000002", "common.pt"), weights_only=False)
    assert "consumed_train_samples" not in common and "layout" not in common
    assert common["args"].consumed_train_samples == 8
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")  # resume from iteration 2

    ours, log = str(tmp_path / "ours"), str(tmp_path / "resumed.jsonl")
    r = run_ranks(1, COMMON + data + ["--load", save, "--save", ours, "--save-interval", "4", "--loss-log", log])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "written by upstream Megatron-LM" in r.stdout
    full, resumed = read_loss_log(full_log), read_loss_log(log)
    assert [x["iteration"] for x in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:]):  # iteration 4's loss follows Adam's saved moments
        assert got["lm loss"] == want["lm loss"] and got["grad norm"] == want["grad norm"], (got, want)
        assert got["consumed samples"] == want["consumed samples"]
    # ours, as upstream's loader reads them
    mine = torch.load(os.path.join(ours, "iter_0000004", "common.pt"), weights_only=False)
    assert mine["args"].consumed_train_samples == 16 and mine["args"].iteration == 4
    assert mine["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"


def _config(tp=1, pp=1, distributed_optimizer=True):
    from megatron.training.checkpoint.config import CheckpointConfig

    return CheckpointConfig(layout=(tp * pp, tp, pp, 1), distributed_optimizer=distributed_optimizer)


def _common(kind, tp=1, pp=1):
    return {"args": SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
            "content_metadata": {"distrib_optim_sharding_type": kind}}


def test_buffer_shaped_optimizer_state_needs_its_layout():
    from megatron.training.checkpoint.protocol import CheckpointError
    from megatron.training.checkpointing import _check_optimizer_format, _content_metadata

    meta = _content_metadata(_common("dp_reshardable", tp=2))
    _check_optimizer_format(_config(tp=2), _common("dp_reshardable", tp=2), meta, "ck")
    _check_optimizer_format(_config(), _common("fully_reshardable", tp=2), _content_metadata(
        _common("fully_reshardable", tp=2)), "ck")  # model-space: any layout
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 2 .this run: 1.; resume with"):
        _check_optimizer_format(_config(), _common("dp_reshardable", tp=2), meta, "ck")
    with pytest.raises(CheckpointError, match="resume with --use-distributed-optimizer"):
        _check_optimizer_format(_config(distributed_optimizer=False), _common("dp_reshardable"), meta, "ck")


def test_checkpoints_without_content_metadata():
    from megatron.training.checkpointing import OPTIMIZER_METADATA, _content_metadata, _consumed_samples

    assert _content_metadata({"layout": (1, 1, 1, 1)}) == OPTIMIZER_METADATA  # ours, before they recorded it
    old_upstream = {"args": SimpleNamespace(use_distributed_optimizer=True)}
    assert _content_metadata(old_upstream)["distrib_optim_sharding_type"] == "dp_zero_gather_scatter"
    assert _content_metadata({"args": SimpleNamespace(use_distributed_optimizer=False)}) == {}
    assert _consumed_samples({"consumed_train_samples": 5, "args": SimpleNamespace()}, "ck") == 5
    assert _consumed_samples({"args": SimpleNamespace(consumed_train_samples=7)}, "ck") == 7

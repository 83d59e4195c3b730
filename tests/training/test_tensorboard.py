"""TensorBoard scalars under Megatron's tags (--tensorboard-dir and its companion flags).

Existing dashboards read 'lm loss', 'learning-rate', 'batch-size', 'loss-scale',
'grad-norm' and their '... vs samples' twins; the values must be the run's own (checked
against the exact --loss-log of the same run), at --tensorboard-log-interval.
"""
import os

import pytest

from tests.support.helpers import read_loss_log, run_ranks

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

pytestmark = pytest.mark.dist

from tests.conftest import DEMO


def scalars(logdir: str) -> dict:
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_dcp_run_writes_megatron_tags_matching_its_loss_log(tmp_path):
    tb, log = str(tmp_path / "tb"), str(tmp_path / "loss.jsonl")
    flags = ["--yaml-cfg", DEMO, "--dcp", "--data-cache-path", str(tmp_path / "cache"),
             "--dcp-global-batch-tokens", "2048", "--train-iters", "6", "--lr-decay-iters", "60",
             "--log-interval", "3", "--eval-interval", "3", "--eval-iters", "1", "--loss-log", log,
             "--tensorboard-dir", tb, "--tensorboard-log-interval", "2", "--log-timers-to-tensorboard",
             "--log-validation-ppl-to-tensorboard"]
    r = run_ranks(2, flags)
    assert r.returncode == 0, r.stderr[-3000:]
    records = {x["iteration"]: x for x in read_loss_log(log)}
    got = scalars(tb)
    for tag in ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "iteration-time"):
        assert [s for s, _ in got[tag]] == [2, 4, 6], tag  # every --tensorboard-log-interval iterations
    for tag, key in (("lm loss", "lm loss"), ("learning-rate", "lr"), ("grad-norm", "grad norm")):
        for step, value in got[tag]:
            assert value == pytest.approx(records[step][key], rel=1e-6, abs=1e-12), (tag, step)
        # the same values against the samples consumed by then
        assert got[f"{tag} vs samples"] == [(records[s]["consumed samples"], v) for s, v in got[tag]]
    assert all(v == 1.0 for _, v in got["loss-scale"])  # fp32/bf16: no loss scaling
    # every --eval-interval, then upstream's end-of-run validation at the last iteration
    assert [s for s, _ in got["lm loss validation"]] == [3, 6, 6]
    for (_, loss), (_, ppl) in zip(got["lm loss validation"], got["lm loss validation ppl"]):
        assert ppl == pytest.approx(2.718281828459045 ** loss, rel=1e-5)


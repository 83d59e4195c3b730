"""The iteration line's `lm loss` is upstream Megatron's: the mean over the --log-interval
window of the iterations that updated the model (a skipped iteration's loss is left out),
so curves logged every 100 iterations compare with upstream's; the --loss-log file keeps
every iteration's own value."""
import json
import re
from types import SimpleNamespace

import pytest

from megatron.training.loop import log as log_module


def logger(tmp_path, interval):
    config = log_module.LogConfig(loss_log=str(tmp_path / "loss.jsonl"), train_iters=9, log_interval=interval)
    return log_module.TrainingLogger(config), config


def run(tmp_path, monkeypatch, losses, ok, interval):
    lines = []
    monkeypatch.setattr(log_module, "print_rank_last", lines.append)
    lg, args = logger(tmp_path, interval)
    for i, (loss, good) in enumerate(zip(losses, ok), start=1):
        lg.log_iteration(i, 8 * i, 0.5, {"lm loss": loss}, object(), SimpleNamespace(param_groups=[]), 1.0, good,
                         1e9, 8)
    printed = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+) \|", "\n".join(lines))]
    with open(args.loss_log) as f:
        recorded = [json.loads(x)["lm loss"] for x in f]
    return printed, recorded


def test_the_line_averages_the_window_and_leaves_skipped_iterations_out(tmp_path, monkeypatch):
    losses = [4.0, 3.0, 9.0, 2.0, 1.5, 1.0]
    printed, recorded = run(tmp_path, monkeypatch, losses, [True, True, False, True, True, True], interval=3)
    assert printed == [pytest.approx((4.0 + 3.0) / 2), pytest.approx((2.0 + 1.5 + 1.0) / 3)]
    assert recorded == losses  # the loss log keeps each iteration's


def test_interval_one_prints_each_loss_and_an_all_skipped_window_its_last(tmp_path, monkeypatch):
    printed, _ = run(tmp_path, monkeypatch, [4.0, 3.0], [True, True], interval=1)
    assert printed == [4.0, 3.0]
    printed, _ = run(tmp_path, monkeypatch, [5.0, 6.0], [False, False], interval=2)
    assert printed == [6.0]

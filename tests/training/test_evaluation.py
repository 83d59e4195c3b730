"""Evaluation as upstream Megatron-LM does it (issue 28), on both paths: each evaluation takes
the next --eval-iters global batches of the validation split (wrapping at its end), the block
between dash lines, and after a run that reached --train-iters the validation and test splits
once more ('iteration N on validation set' / 'on test set'); --eval-interval defaults to None.

The runs train at --lr 0: the weights never move, so an evaluation's loss tells its batches.
"""
import re

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import drop_flags, run_ranks

BLOCK = re.compile(r"^ validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| $")


def blocks(stdout: str) -> list[tuple[str, float]]:
    """(prefix, loss) of every validation block, each checked to stand between upstream's dash lines."""
    lines = stdout.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = BLOCK.match(line)
        if m:
            dashes = "-" * (len(line) + 1)
            assert lines[i - 1] == dashes and lines[i + 1] == dashes, lines[i - 1:i + 2]
            found.append((m.group(1), float(m.group(2))))
    return found


def flags_for(corpus: str, cache: str, *extra: str) -> list[str]:
    return drop_flags(TINY_MODEL, "--lr", "--min-lr", "--eval-iters", "--eval-interval", "--split") + [
        "--lr", "0", "--min-lr", "0", "--seed", "1234", "--data-path", corpus, "--data-cache-path", cache,
        "--split", "60,30,10", *extra]


def test_the_block_is_upstreams(capsys):
    from megatron.training.loop.log import LogConfig, TrainingLogger

    logger = TrainingLogger(LogConfig())
    logger.log_validation(7, 2.0)
    logger.log_validation(7, 2.0, "iteration 7 on test set")
    line = " validation loss at iteration 7 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    test = " validation loss at iteration 7 on test set | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert capsys.readouterr().out.splitlines() == ["-" * (len(line) + 1), line, "-" * (len(line) + 1),
                                                    "-" * (len(test) + 1), test, "-" * (len(test) + 1)]


def test_a_resumed_run_goes_on_where_upstreams_count_puts_it():
    from megatron.training.loop.run import LoopConfig, validation_batches_before

    assert validation_batches_before(LoopConfig(train_iters=20, eval_interval=5, eval_iters=3), 12) == 6  # evaluated at 5, 10
    assert validation_batches_before(LoopConfig(train_iters=20, eval_interval=None, eval_iters=3), 12) == 0


@pytest.mark.dist
def test_static_evaluations_walk_on_then_validation_and_test_at_the_end(text_corpus, tmp_path):
    batch = ["--micro-batch-size", "2", "--global-batch-size", "2"]
    r = run_ranks(1, flags_for(text_corpus, str(tmp_path / "c"), "--train-iters", "3", "--eval-iters", "1",
                               "--eval-interval", "1", *batch))
    assert r.returncode == 0, r.stderr[-3000:]
    got = blocks(r.stdout)
    assert [p for p, _ in got] == ["iteration 1", "iteration 2", "iteration 3", "iteration 3 on validation set",
                                   "iteration 3 on test set"]
    valid = [loss for p, loss in got[:4]]
    assert len(set(valid)) == 4, valid  # four different validation batches, not the first one four times
    # --eval-interval's default (None): no evaluation during training, one pass at the end,
    # here over the same four batches the run above walked through one by one
    r = run_ranks(1, flags_for(text_corpus, str(tmp_path / "c"), "--train-iters", "1", "--eval-iters", "4", *batch))
    assert r.returncode == 0, r.stderr[-3000:]
    got = blocks(r.stdout)
    assert [p for p, _ in got] == ["iteration 1 on validation set", "iteration 1 on test set"]
    assert got[0][1] == pytest.approx(sum(valid) / 4, rel=1e-5)  # equal tokens per batch: the mean


@pytest.mark.dist
def test_dcp_evaluations_walk_on_and_wrap_then_validation_and_test_at_the_end(text_corpus, tmp_path):
    from dcp_ext.data.documents import build_document_datasets
    from megatron.training.adaptive.training_adaptive import SplitBatches, StepOptions
    from megatron.training.loop.batch_schedule import GlobalBatchSizes

    tokens, max_len = 1024, 128
    _, valid_ds, _ = build_document_datasets([text_corpus], "60,30,10", seed=1234, max_seq_len=max_len)
    options = StepOptions(global_batch_tokens=tokens, max_seq_len=max_len, seq_length=max_len,
                          batch_sizes=GlobalBatchSizes(1), train_iters=1, lr_step_increment=1)
    walk = SplitBatches(options, valid_ds)
    first = [walk.next().sample_ids for _ in range(8)]
    n = next(k for k in range(1, 7) if first[k] == first[0])  # the validation split's batches
    assert n >= 2 and first[n + 1] == first[1]
    r = run_ranks(1, flags_for(text_corpus, str(tmp_path / "c"), "--dcp", "--dcp-global-batch-tokens", str(tokens),
                               "--dcp-recalibration", "off", "--train-iters", str(n + 1), "--eval-iters", "1",
                               "--eval-interval", "1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = blocks(r.stdout)
    last = n + 1
    assert [p for p, _ in got] == [f"iteration {i}" for i in range(1, last + 1)] + [
        f"iteration {last} on validation set", f"iteration {last} on test set"]
    valid = [loss for _, loss in got[:-1]]
    assert len(set(valid[:n])) == n, valid  # the split's batches one after another
    for i in range(n, len(valid)):  # then from its start again
        assert valid[i] == pytest.approx(valid[i - n], rel=1e-5), (i, valid)

"""A --dcp checkpoint resumes on any world size, whatever the vocabulary (issue 24, class D).

The padded vocabulary of a --dcp run used to follow the largest tensor-parallel size of the
run's candidate pool, which depends on the world size (vocabulary 255 -> 512 rows on 4
ranks, 256 on 2, 384 on 1): a checkpoint saved on 4 ranks was refused on 1 or 2 as another
model. Now it depends on the model and the flags alone. A 4-rank run (a model whose heads
and query groups allow tp 4) saves at iteration 3 and runs on to 6; its checkpoint resumes
on 1, 2 and 8 ranks and the losses of iterations 4-6 equal the unbroken run's within 1e-5,
for a vocabulary of 255 and of 300 (padded to 512 either way).
"""
import os
import shutil

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import drop_flags, read_loss_log, run_ranks

pytestmark = pytest.mark.dist

# tp up to 4 is valid for this model (4 heads, 4 query groups): the pool on 4 and 8 ranks holds it
MODEL = drop_flags(TINY_MODEL, "--num-query-groups", "--vocab-size") + ["--num-query-groups", "4"]
DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--dcp-recalibration", "off", "--lr-decay-iters", "8"]


def flags(corpus, cache, vocab, log, *extra):
    return MODEL + DCP + ["--vocab-size", str(vocab), "--data-path", corpus, "--data-cache-path", cache,
                          "--loss-log", log, *extra]


@pytest.mark.parametrize("vocab", [255, 300])
def test_checkpoint_of_four_ranks_resumes_on_one_two_and_eight(vocab, text_corpus, tmp_path):
    cache, saved = str(tmp_path / "cache"), str(tmp_path / "saved")
    full = str(tmp_path / "full.jsonl")
    r = run_ranks(4, flags(text_corpus, cache, vocab, full, "--train-iters", "6", "--save", saved,
                           "--save-interval", "3"))
    assert r.returncode == 0, r.stderr[-3000:]
    reference = {x["iteration"]: x["lm loss"] for x in read_loss_log(full)}
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    # the checkpoint of iteration 3 alone (the tracker of the full run names 6)
    start = str(tmp_path / "at3")
    os.makedirs(start)
    shutil.copytree(os.path.join(saved, "iter_0000003"), os.path.join(start, "iter_0000003"))
    with open(os.path.join(start, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    for nproc in (1, 2, 8):
        log = str(tmp_path / f"resumed{nproc}.jsonl")
        r = run_ranks(nproc, flags(text_corpus, cache, vocab, log, "--train-iters", "6", "--load", start))
        assert r.returncode == 0, (nproc, r.stderr[-3000:])
        resumed = read_loss_log(log)
        assert [x["iteration"] for x in resumed] == [4, 5, 6], nproc
        for x in resumed:
            assert x["lm loss"] == pytest.approx(reference[x["iteration"]], rel=1e-5), (nproc, x)

"""What a --dcp run leaves out is said at start, in one line each (issue 24, class G):
documents cut at --dcp-max-seq-len used to drop most of their tokens silently (every document
1000 tokens, max 128: 87% never trained), and an evaluation asked for with an empty
validation split never ran, with no line."""
import numpy as np
import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import run_ranks

pytestmark = pytest.mark.dist

DCP = ["--dcp", "--dcp-global-batch-tokens", "512", "--train-iters", "2", "--split", "100,0,0"]


def warnings(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("WARNING: ")]


def test_truncation_and_a_missing_validation_split_are_said(text_corpus, tmp_path):
    from dcp_ext.data.indexed import IndexedDocuments

    lengths = IndexedDocuments(text_corpus).lengths.astype(np.int64)
    cut, dropped, total = int((lengths > 64).sum()), int(np.maximum(lengths - 64, 0).sum()), int(lengths.sum())
    r = run_ranks(1, TINY_MODEL + DCP + ["--dcp-max-seq-len", "64", "--eval-iters", "1", "--eval-interval", "1",
                                         "--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")])
    assert r.returncode == 0, r.stderr[-3000:]
    said = warnings(r.stdout)
    assert len(said) == 2, said
    assert said[0] == (f"WARNING: --dcp-max-seq-len 64 cuts {cut:,} of the train split's {len(lengths):,} documents "
                       f"to their first 64 tokens: {dropped:,} of {total:,} tokens ({100 * dropped / total:.1f}%) "
                       "never train; --dcp-split-long-documents trains them as further samples, or raise "
                       "--dcp-max-seq-len")
    assert said[1].startswith("WARNING: no evaluation: --split 100,0,0 leaves the validation split without a "
                              "document, so --eval-iters 1 --eval-interval 1 never run")


def test_nothing_is_said_when_nothing_is_left_out(text_corpus, tmp_path):
    r = run_ranks(1, TINY_MODEL + DCP + ["--dcp-max-seq-len", "128", "--dcp-split-long-documents", "--eval-iters", "0",
                                         "--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert warnings(r.stdout) == []


def test_overlap_flags_say_in_one_line_why_they_are_off_on_cpu(text_corpus, tmp_path):
    """Overlapping gloo transfers with compute on the same cores made exposed communication
    worse (benchmarks/bench_overlap.py): on CPU ranks --dcp turns it off and says so, once."""
    from megatron.training.adaptive.run_config import OVERLAP_OFF_ON_CPU

    flags = TINY_MODEL + DCP + ["--dcp-max-seq-len", "128", "--dcp-split-long-documents", "--eval-iters", "0",
                                "--data-path", text_corpus, "--data-cache-path", str(tmp_path / "cache"),
                                "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    r = run_ranks(2, flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines().count(OVERLAP_OFF_ON_CPU) == 1, r.stdout[-3000:]
    plain = run_ranks(2, flags[:-2])
    assert plain.returncode == 0 and OVERLAP_OFF_ON_CPU not in plain.stdout

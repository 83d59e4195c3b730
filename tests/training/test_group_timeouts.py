"""Every process group a run creates waits --distributed-timeout-minutes (issue 37, class C).

A stalled rank hung the static path for more than 10 minutes under
`--distributed-timeout-minutes 1`: the flag reached only the default group, and
megatron-core's model-parallel groups (and the adaptive runtime's) kept torch's 30-minute
default. Here a real 2-rank run of each path (tensor-parallel on the static path: TP, DP,
PP, CP, embedding and gloo groups) writes every live group's timeout just before it ends
(tests/support/group_timeout_entry.py), and each must be the flag's.
"""
import glob
import json
import os

import pytest

from tests.conftest import TINY_MODEL
from tests.support.helpers import REPO, run_ranks

pytestmark = pytest.mark.dist

PATHS = {"static": ["--micro-batch-size", "2", "--global-batch-size", "4", "--tensor-model-parallel-size", "2"],
         "dcp": ["--dcp", "--dcp-global-batch-tokens", "512"]}


@pytest.mark.parametrize("path", ["static", "dcp"])
def test_every_group_waits_the_flags_timeout(path, text_corpus, tmp_path):
    log = str(tmp_path / "timeouts")
    flags = TINY_MODEL + PATHS[path] + ["--train-iters", "1", "--data-path", text_corpus, "--data-cache-path",
                                        str(tmp_path / "cache"), "--distributed-timeout-minutes", "7"]
    r = run_ranks(2, flags, env={"DCP_GROUP_TIMEOUTS": log}, entry=os.path.join(REPO, "tests", "support", "group_timeout_entry.py"),
                  timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(glob.glob(log + ".*"))
    assert len(files) == 2, files
    groups = [json.loads(line) for p in files for line in open(p)]
    assert len(groups) >= 2 * 3, groups  # the default group and the run's own (at least 2), on each rank
    wrong = [g for g in groups if g["timeout_s"] != 7 * 60]
    assert not wrong, f"{len(wrong)} of {len(groups)} groups do not wait 7 min: {wrong[:5]}"

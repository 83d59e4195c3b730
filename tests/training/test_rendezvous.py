"""A rank whose peers never come says so in one line within --distributed-timeout-minutes
(issue 24, class E): `WORLD_SIZE=2 RANK=0` under plain python used to wait and then end in
torch's DistStoreError traceback."""
import pytest

from tests.support.helpers import free_port, run_ranks
from tests.support.helpers import assert_one_line_error

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # it waits the whole minute, by design

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
         "32", "--train-iters", "1", "--lr", "1e-3", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--distributed-timeout-minutes", "1"]


def test_rank_zero_alone_names_the_rendezvous_and_the_world(tmp_path):
    port = str(free_port())
    r = run_ranks(1, FLAGS + ["--data-cache-path", str(tmp_path / "cache")], timeout=240,
                  env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
    assert_one_line_error(r, f"rank 0 waited 1 min at MASTER_ADDR 127.0.0.1:{port} for the other ranks of "
                             "WORLD_SIZE=2, 1 of 2 joined")

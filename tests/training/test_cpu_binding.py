"""CPU runs bind each local rank to its share of the cores (megatron/training/startup/cpu_binding.py).

The split itself is pure and checked here on machines of every shape; the binding is
checked in a fresh interpreter (it changes the process it runs in): every thread the
process had, and any it starts later, runs on the rank's cores. A real 4-rank run's
binding is checked in tests/runtime/test_online_calibration.py (group_count_entry records it)."""
import json
import os
import subprocess
import sys

import pytest

from megatron.training.startup.cpu_binding import cores_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("cores", [[0, 1], [0, 1, 2, 3, 4, 5, 6, 7], [2, 3, 5], list(range(64))])
@pytest.mark.parametrize("local_world", [2, 3, 4, 8])
def test_every_core_is_used_and_ranks_share_evenly(cores, local_world):
    shares = [cores_for(r, local_world, cores) for r in range(local_world)]
    assert all(shares) and all(set(s) <= set(cores) for s in shares)
    if local_world <= len(cores):
        # disjoint contiguous blocks covering every core, sizes differing by at most one
        assert sorted(c for s in shares for c in s) == cores
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        # one core each, every core used, consecutive ranks together, loads differing by one
        assert all(len(s) == 1 for s in shares)
        used = [s[0] for s in shares]
        assert sorted(set(used)) == cores and used == sorted(used)
        loads = [used.count(c) for c in cores]
        assert max(loads) - min(loads) <= 1


def test_four_ranks_on_two_cores_pair_up():
    assert [cores_for(r, 4, [0, 1]) for r in range(4)] == [[0], [0], [1], [1]]


SCRIPT = r"""
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from megatron.training.startup.cpu_binding import bind_cpu_rank
before = threading.Event(); seen = {}
def early():  # a thread started before the binding (gloo's, torch's)
    before.wait(); seen["early"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=early); t.start()
mine = bind_cpu_rank({"LOCAL_RANK": sys.argv[2], "LOCAL_WORLD_SIZE": sys.argv[3]})
before.set(); t.join()
late = threading.Thread(target=lambda: seen.__setitem__("late", sorted(os.sched_getaffinity(0))))
late.start(); late.join()
print(json.dumps({"mine": mine, "main": sorted(os.sched_getaffinity(0)), **seen}))
"""


def _bind(local_rank, local_world):
    r = subprocess.run([sys.executable, "-c", SCRIPT, REPO, str(local_rank), str(local_world)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.dist
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split")
def test_binding_covers_every_thread():
    allowed = sorted(os.sched_getaffinity(0))
    got = _bind(1, 2)
    want = cores_for(1, 2, allowed)
    assert got["mine"] == want and len(want) < len(allowed)
    assert got["main"] == got["early"] == got["late"] == want


@pytest.mark.dist
def test_nothing_to_split_leaves_the_process_alone():
    allowed = sorted(os.sched_getaffinity(0))
    got = _bind(0, 1)  # one local rank
    assert got["mine"] is None and got["main"] == allowed

"""pretrain_gpt_dcp.py with the timeout of every process group written down at the end.

Why it exists: a stalled rank ends the job within --distributed-timeout-minutes only if every
group the run created waits that long, megatron-core's and the adaptive runtime's included
(issue 37, class C: megatron-core's kept their 30-minute default). This wrapper lets a test
read it from outside: just before the run destroys its process groups, each rank writes one
JSON line per live group (its ranks, backend, timeout in seconds) to DCP_GROUP_TIMEOUTS.RANK,
then the real entry point goes on unchanged.
"""
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG = os.environ["DCP_GROUP_TIMEOUTS"]
destroy = dist.destroy_process_group


def _timeouts(group=None):
    if group is None and dist.is_initialized():
        with open(f"{LOG}.{dist.get_rank()}", "w") as f:
            for pg in list(c10d._world.pg_map):
                backend = pg._get_backend(torch.device("cpu"))
                f.write(json.dumps({"ranks": dist.get_process_group_ranks(pg), "backend": type(backend).__name__,
                                    "timeout_s": backend.options._timeout.total_seconds()}) + "\n")
    return destroy(group)


dist.destroy_process_group = _timeouts
sys.path.insert(0, REPO)
sys.argv[0] = os.path.join(REPO, "pretrain_gpt_dcp.py")
runpy.run_path(sys.argv[0], run_name="__main__")

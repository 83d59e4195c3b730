"""pretrain_gpt_dcp.py with every process-group creation written down (rank, iterations done).

Why it exists: on NCCL a new communicator costs seconds and must be created by every rank in
the same order, so the adaptive runtime creates every group its pool may need at start and
none once training runs. This wrapper lets a test see that from outside the runtime: it
wraps torch.distributed.new_group/new_subgroups (which megatron-core and the runtime call
through the module) and counts the iterations the loop has logged, then runs the real entry
point unchanged. DCP_GROUP_LOG names the file prefix (one `.RANK` file per rank, JSON lines);
each record also holds the cores the rank ran on then (megatron/training/startup/cpu_binding.py).
"""
import json
import os
import runpy
import sys

import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOG = os.environ["DCP_GROUP_LOG"]
iterations_done = [0]


def _recorded(name, create):
    def wrapped(*args, **kwargs):
        with open(f"{LOG}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps({"call": name, "iterations_done": iterations_done[0],
                                "cores": sorted(os.sched_getaffinity(0))}) + "\n")
        return create(*args, **kwargs)
    return wrapped


def _counting(log):
    def wrapped(self, iteration, *args, **kwargs):
        iterations_done[0] = iteration
        return log(self, iteration, *args, **kwargs)
    return wrapped


dist.new_group = _recorded("new_group", dist.new_group)
dist.new_subgroups = _recorded("new_subgroups", dist.new_subgroups)
sys.path.insert(0, REPO)
from megatron.training.static import training_static  # noqa: E402
from megatron.training.adaptive import training_adaptive

training_adaptive.AdaptiveSteps.log = _counting(training_adaptive.AdaptiveSteps.log)
training_static.StaticSteps.log = _counting(training_static.StaticSteps.log)
sys.argv[0] = os.path.join(REPO, "pretrain_gpt_dcp.py")
runpy.run_path(sys.argv[0], run_name="__main__")

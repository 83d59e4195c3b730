"""pretrain_gpt_dcp.py on the simulated CUDA device, observed: one JSON report per rank.

Run under torchrun like the real entry point (`torchrun ... tests/support/simulated_cuda/entry.py
FLAGS`); SIMULATED_CUDA_REPORT names the report's prefix (`PREFIX.RANK.json`). The report
holds, per training iteration, the host synchronisations inside the step (kind and call
site) and the device collectives in issue order; the bytes the rank allocated while the
model and optimizer were built (peak, and at rest) beside the cost model's charge for its
layouts; at rest again after the first step (the optimizer's moments exist then); and
every fault recorded. Faults raise where they happen, as on a GPU: the run then ends with
its error line and the report says which.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, REPO)

from tests.support import simulated_cuda  # noqa: E402

sim = simulated_cuda.install(os.environ.get("SIMULATED_CUDA_SHIM"))

import torch  # noqa: E402

REPORT = os.environ.get("SIMULATED_CUDA_REPORT")
report = {"steps": [], "build": None, "after_first_step": None, "faults": [], "group_ranks": {}}


def _write() -> None:
    if not REPORT:
        return
    report["faults"] = simulated_cuda.violations()
    report["group_ranks"] = sim.group_ranks
    report["host_groups"] = sorted(sim.host_groups)
    with open(f"{REPORT}.{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(report, f, indent=1)


def _observe_steps(cls) -> None:
    run = cls.run

    def observed(self, iteration):
        syncs, collectives = len(sim.sync_log), len(sim.collective_log)
        try:
            return run(self, iteration)
        finally:
            report["steps"].append({"iteration": iteration + 1, "path": cls.__name__,
                                    "syncs": sim.sync_log[syncs:], "collectives": sim.collective_log[collectives:]})
            if len(report["steps"]) == 1:
                report["after_first_step"] = {"allocated": sim.allocated}
            _write()

    cls.run = observed


def _observe_build() -> None:
    from megatron.training.adaptive import training_adaptive

    build = training_adaptive.AdaptiveRun.build

    def observed(self, peak_memory):
        before, total_before = sim.allocated, sim.allocated_total
        sim.peak = sim.allocated
        try:
            return build(self, peak_memory)
        finally:
            rank = torch.distributed.get_rank()
            cm = self.planner.cm
            mine = [t for t in self.planner.replica_types() if rank in t.ranks]
            charge = max((cm.state_bytes(t.layout) for t in mine), default=0.0) - cm.communicator_bytes
            held = getattr(self, "engine", None)
            report["build"] = {"before": before, "peak": sim.peak, "at_rest": sim.allocated,
                               "allocated_total": sim.allocated_total - total_before,
                               "charge": charge, "adam_moments": 8.0 * held.optimizer.flat.numel() if held else None,
                               "engine_persistent": sum(held.persistent_bytes().values()) if held else None}
            _write()

    training_adaptive.AdaptiveRun.build = observed


def main() -> None:
    from megatron.training.adaptive import training_adaptive
    from megatron.training.static import training_static

    _observe_steps(training_static.StaticSteps)
    _observe_steps(training_adaptive.AdaptiveSteps)
    _observe_build()
    import pretrain_gpt_dcp

    try:
        pretrain_gpt_dcp.main(sys.argv[1:])
    finally:
        _write()


if __name__ == "__main__":
    main()

"""`--dcp-recalibration on`: the step's timings reduced over ranks and queued for the planner.

Glue only. The runtime times each micro-batch and replica (dcp_ext.runtime.timing); one
MAX all-reduce makes the numbers the same on every rank; dcp_ext.planning.calibration
turns them into an observation the planner's cost model refits from. The refit happens
in `between_plans`, which the loop calls only while the background planner is idle, so
every rank plans each iteration from the same prices.
"""
from __future__ import annotations

from dcp_ext.planning.calibration import Calibration, observe
from dcp_ext.runtime.timing import reduce_step


class OnlineCalibration:
    def __init__(self, planner, device):
        self.planner = planner
        self.device = device
        self.calibration = Calibration()
        planner.calibrate_online(self.calibration)

    def between_plans(self) -> bool:
        """Apply what was measured since the last call; True when the prices changed."""
        return self.planner.recalibrate()

    def measured(self, it, batch, result, wall_s: float) -> None:
        """Queue iteration `it`'s timings (collective: every rank calls it after each step)."""
        t = reduce_step(it, result.timings, wall_s, self.device)
        lengths = dict(zip((int(i) for i in batch.sample_ids), (int(n) for n in batch.lengths)))
        self.calibration.add(observe(it, lengths, t.micro_batches, t.sync_s, t.replica_s, t.wall_s,
                                     self.planner.cm.stage_recompute))

    def state_dict(self) -> dict:
        return self.calibration.state_dict()

    def summary(self) -> str:
        return self.calibration.summary()

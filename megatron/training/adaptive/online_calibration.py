"""`--dcp-recalibration on`: the step's timings reduced over ranks and queued for the planner.

Glue only. The runtime times each micro-batch and replica (dcp_ext.runtime.schedule.timing); one
MAX all-reduce makes the numbers the same on every rank; dcp_ext.planning.calibration
turns them into an observation the planner's cost model refits from. The refit happens
in `between_plans`, which the loop calls only while the background planner is idle, so
every rank plans each iteration from the same prices.
"""
from __future__ import annotations

from dcp_ext.planning.calibration import Calibration, observe
from dcp_ext.runtime.schedule.timing import reduce_step


class OnlineCalibration:
    def __init__(self, planner, device, peak_memory=None, host_group=None):
        """peak_memory: this rank's PeakMemory (memory_report); its peak per iteration against
        the plan's prediction is the memory the cost model misses. host_group: the engine's
        gloo group over every rank (GPU runs), which reduces the timings on the host."""
        self.planner = planner
        self.device = device
        self.host_group = host_group
        self.peak_memory = peak_memory
        self.calibration = Calibration()
        self.last = None  # the last step's StepTimings (the same on every rank)
        planner.calibrate_online(self.calibration)

    def charge_at_rest(self, engine) -> float:
        """Before training (collective): the memory the built runtime holds beyond its
        persistent bytes (model objects, communication buffers, the allocator's own),
        measured now, the most over ranks, is charged as the first measured excess, so the
        first plans keep the budget too (the step's own excess is measured from the first
        step on). Returns the bytes."""
        import torch
        import torch.distributed as dist

        held = self.peak_memory.current_bytes() if self.peak_memory is not None else None
        excess = 0.0 if held is None else max(0.0, held - float(sum(engine.persistent_bytes().values())))
        # the most over ranks: every rank's planner must charge the same, or their plans differ
        t = torch.tensor([excess], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        excess = float(t.item())
        self.planner.charge_measured_memory(excess)
        return excess

    def between_plans(self) -> bool:
        """Apply what was measured since the last call; True when the prices changed. Called
        just before a step: the memory window starts here (loading, saving and evaluating
        between steps are not the plan's to answer for)."""
        if self.peak_memory is not None:
            self.peak_memory.window_peak_bytes()
        return self.planner.recalibrate()

    def measured(self, it, batch, result, wall_s: float, probe: bool = False) -> None:
        """Queue iteration `it`'s timings (collective: every rank calls it after each step);
        `probe`: a step of the startup calibration, not of training."""
        lengths = dict(zip((int(i) for i in batch.sample_ids), (int(n) for n in batch.lengths)))
        t = reduce_step(it, result.timings, wall_s, self.device, self._memory_excess(it, lengths),
                        host_group=self.host_group)
        self.last = t
        self.calibration.add(observe(it, lengths, t.micro_batches, t.sync_s, t.replica_s, t.wall_s,
                                     self.planner.cm.stage_recompute, t.memory_excess, probe=probe))

    def balance_record(self, it) -> dict:
        """The last step's per-replica forward+backward (measured, summed over its micro-batches
        and stages) beside the plan's predicted replica times, for the --loss-log line: the
        exposed wait split into the imbalance the plan predicted and the one it missed."""
        if self.last is None:
            return {}
        return {"replica_compute_s": [round(sum(m), 6) for m in self.last.micro_batches],
                "replica_predicted_s": [round(r.predicted_time_s, 6) for r in it.replicas]}

    def _memory_excess(self, it, lengths: dict) -> float:
        """Bytes this rank held during the step above its replica's predicted peak (0 unmeasured)."""
        import torch.distributed as dist

        from dcp_ext.planning.simulator import simulate_replica

        measured = self.peak_memory.window_peak_bytes() if self.peak_memory is not None else None
        if measured is None:
            return 0.0
        predicted = simulate_replica(self.planner.cm, it.replica_of(dist.get_rank()), lengths, len(it.replicas))
        return max(0.0, measured - predicted.peak_bytes)

    def state_dict(self) -> dict:
        return self.calibration.state_dict()

    def summary(self) -> str:
        return self.calibration.summary()

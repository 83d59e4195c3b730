"""What a training step took, per micro-batch and per replica, the same on every rank.

Why it exists: online recalibration (dcp_ext.planning.calibration) refits the cost model
from the run's own timings, and every rank plans on its own, so every rank must refit
from the same numbers. Each rank times its stage's forward and backward of every
micro-batch (`dcp_ext.runtime.device_clock.DeviceClock`: wall clock on the CPU, CUDA events
on a GPU, read once after the step), and its pull+push and whole replica step; `reduce_step`
places them in slots known from the plan on every rank and takes one MAX all-reduce (a
stage's slowest rank is the stage's time; only one stage writes each slot), so everyone
gets the same `StepTimings`. The numbers are host numbers by then: the reduction runs
over a host (gloo) group when the run has one, so it adds no wait for the device.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcp_ext.runtime.host_device import to_device


# The phases of one `--dcp` step, as Megatron's --timing-log-level 2 timers name them: the
# wait for the prefetched plan, fetching and packing this rank's documents, the pull (its
# part not overlapped), the replica's forward and backward (waits for peers included), the
# push, the optimizer step on the shard, and the step's reductions.
PHASES = ("dcp-plan-wait", "dcp-fetch-pack", "dcp-pull", "forward-backward", "dcp-push", "optimizer", "dcp-reduce")


def untimed(name: str):
    return nullcontext()


@dataclass
class LocalTimings:
    """One rank's share: its replica (plan position), stage, micro-batch times, sync, step."""

    replica: int
    stage: int
    micro_batches: list[float]
    sync_s: float
    replica_s: float


@dataclass
class StepTimings:
    """Reduced over ranks: per replica (plan order) its micro-batches' forward+backward
    summed over stages, the exchange's own time (the quickest rank's pull+push: the same for
    every replica), its whole step; and the iteration's wall time."""

    micro_batches: list[list[float]]
    sync_s: list[float]
    replica_s: list[float]
    wall_s: float
    memory_excess: float = 0.0  # bytes: the most any rank held above its replica's predicted peak


def reduce_step(it, local: LocalTimings, wall_s: float, device, memory_excess: float = 0.0,
                host_group=None) -> StepTimings:
    """One MAX all-reduce over every rank (collective: every rank calls it each step).
    `memory_excess`: bytes this rank held above its replica's predicted peak. `host_group`:
    a gloo group over every rank (the engine's `host_group`), which reduces the host numbers
    where they are; without one they go through the device."""
    shapes = [(len(r.micro_batches), r.pp) for r in it.replicas]
    offsets, o = [], 0
    for n, pp in shapes:
        offsets.append(o)
        o += n * pp
    n_rep = len(shapes)
    values = torch.zeros(o + 2 * n_rep + 3, dtype=torch.float64)
    base = offsets[local.replica]
    pp = shapes[local.replica][1]
    for j, secs in enumerate(local.micro_batches):
        values[base + j * pp + local.stage] = secs
    values[o + local.replica] = local.sync_s
    values[o + n_rep + local.replica] = local.replica_s
    values[-3] = memory_excess
    values[-2] = -local.sync_s  # MAX of the negatives: the quickest rank's pull+push
    values[-1] = wall_s
    if host_group is None:
        values = to_device(values, device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=host_group)
    v = values.cpu().tolist()
    mbs = [[sum(v[offsets[r] + j * pp + p] for p in range(pp)) for j in range(n)] for r, (n, pp) in enumerate(shapes)]
    # Every rank takes part in every bucket of the pull and the push, so a rank's time there
    # is the transfer plus its wait for the last rank to arrive (an imbalance of compute, not
    # a price of the exchange: counted as one it made a 4-rank CPU run price sync 40x and pick
    # tp2 over dp4). The last to arrive waits for nobody: the quickest time is the transfer.
    exchange = -v[-2]
    sync = [exchange if v[o + r] > 0 else 0.0 for r in range(n_rep)]
    return StepTimings(mbs, sync, v[o + n_rep : o + 2 * n_rep], v[-1], v[-3])

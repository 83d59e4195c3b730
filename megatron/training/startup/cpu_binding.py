"""Each rank of a CPU (gloo) run on its own share of the node's cores.

Why it exists: left to the kernel, the ranks of a CPU run migrate between cores, and when
they outnumber the cores the scheduler does not share them evenly within a step. Measured
on 2 cores with 4 data-parallel ranks (`--dcp --dcp-planner static`, the demo): every rank
spent 0.70-0.80 s of CPU time on its forward and backward, but 0.8-2.0 s of wall time, so
the rank that got a core to itself waited up to half the iteration for the others at the
gradient exchange while a core went idle at the end. Bound, ranks that share a core share
it with the same ranks all along (the kernel is fair between them), and no rank moves.

Ranks are split over the cores they may run on (`os.sched_getaffinity`, so a SLURM or
taskset binding is subdivided, not ignored): a contiguous block of cores per rank when
there are at least as many cores as local ranks, else consecutive ranks share a core.
GPU runs are left alone (their ranks follow their GPUs).
"""
from __future__ import annotations

import os


def cores_for(local_rank: int, local_world: int, cores: list[int]) -> list[int]:
    """The cores local rank `local_rank` of `local_world` runs on, from `cores` (sorted)."""
    n = len(cores)
    if local_world <= n:
        lo, hi = local_rank * n // local_world, (local_rank + 1) * n // local_world
        return cores[lo:hi]
    return [cores[local_rank * n // local_world]]


def bind_cpu_rank(env=None) -> list[int] | None:
    """Bind this process (every thread it has now, and those it starts later) to its share of
    the cores; the cores, or None where there is nothing to split (one local rank, one core,
    no LOCAL_RANK/LOCAL_WORLD_SIZE as torchrun sets them, or no affinity on this system)."""
    env = os.environ if env is None else env
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if local_world <= 1 or len(cores) <= 1 or not 0 <= local_rank < local_world:
        return None
    mine = cores_for(local_rank, local_world, cores)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:  # a thread that ended meanwhile, or a binding the system refuses
            pass
    return mine

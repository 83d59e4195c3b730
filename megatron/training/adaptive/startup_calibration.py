"""`--dcp-calibrate-at-start`: measure every candidate layout on this machine before training.

Why it exists: the candidate pool is chosen from prices, and before any measurement those
are the analytic prior's (or a profile's from another day), which can be off by several
times and by different factors per layout (on 4 gloo ranks, 4.4x on the first iterations).
A layout the prior misprices may then never be run, so never measured, so never chosen.
Here, before the first iteration, every layout a pool may use runs half of the job's own
first global batch (the longest document that layout holds and every second one after it)
on every aligned block of ranks at once, as training runs it (the ranks share the machine
as they will), with pull, forward, backward and push but no optimizer update
(`AdaptiveEngine.train_iteration(..., update=False)`).
The timings go to the online calibration as a training step's do; the pool is then chosen
again from the measured prices, and training starts from them.

Every rank takes the same decisions from the same reduced numbers, so plans stay identical
on every rank. The parameters, the optimizer and the data order are untouched, and no
process group is created: the layouts are the planner's registered reserve.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

PROBE_EVERY = 2  # of the first batch's documents a layout holds, longest first, every 2nd: half the time


@dataclass(frozen=True)
class ProbeBatch:
    """What `OnlineCalibration.measured` reads of a batch."""

    sample_ids: list
    lengths: list


def wanted(config, planner, consumed_samples: int) -> bool:
    """Whether this run measures its layouts before training: a fresh adaptive run that
    recalibrates online (a resumed one has its measurements in the checkpoint). `config`:
    the run's PlannerConfig."""
    return (config.calibrate_at_start and config.rechoose_pool and consumed_samples == 0
            and hasattr(planner, "probe_layouts"))


def calibrate_at_start(engine, planner, recalibration, dataset, batch, index: int = -1, **step_options) -> str | None:
    """Run every probe layout once on `batch` (a GlobalBatch: sample_ids, lengths), feed the
    timings to `recalibration`, apply them and choose the pool again. Collective. Returns the
    line to say (None: nothing was measured, because the batch has no token to train on or the
    entry point's forward_step cannot run under --dcp: the first iteration says which in its own
    line). `step_options` go to every probe step as to a training step (eod_mask_loss, eod)."""
    from dcp_ext.runtime.step_result import ForwardStepError, NoTrainableTokens

    started = time.perf_counter()
    measured = []
    for lay in planner.probe_layouts():
        it = planner.probe_plan(index, lay, batch.sample_ids, batch.lengths, every=PROBE_EVERY)
        if it is None:
            continue
        t0 = time.perf_counter()
        try:
            result = engine.train_iteration(it, dataset, update=False, **step_options)
        except (NoTrainableTokens, ForwardStepError):  # nothing to time: the first iteration says why in one line
            return None
        wall = time.perf_counter() - t0
        lengths = dict(zip(batch.sample_ids, batch.lengths))
        recalibration.measured(it, ProbeBatch(list(it.sample_ids), [lengths[i] for i in it.sample_ids]), result, wall,
                                  probe=True)
        recalibration.between_plans()  # the next probe is planned with what this one measured (memory too)
        measured.append(f"{lay.tp}/{lay.cp}/{lay.pp} {1000 * recalibration.last.wall_s:.0f}/{1000 * it.predicted_time_s:.0f}")
    planner.choose_pool_now()
    took = time.perf_counter() - started
    return (f"> dcp: measured {len(measured)} layouts on the first global batch before training in {took:.1f} s "
            f"(tp/cp/pp measured/predicted ms: {', '.join(measured)}); candidate pool from the measured prices: "
            + "; ".join(planner.describe().split(": ", 2)[-1:]))

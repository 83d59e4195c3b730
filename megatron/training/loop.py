"""The training loop both paths share: iterate, stop on a NaN streak, evaluate, save, exit.

Why it exists: the static path (megatron-core's schedules) and the --dcp path (the
adaptive engine) differ in how one iteration runs, is logged, evaluated and saved, not
in the rules around it. Those rules are written once here; each path hands in a `Steps`
object with its own five operations.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from dcp_ext.data import file_guard
from megatron.training.errors import TrainingError


@dataclass(frozen=True)
class Outcome:
    """What one iteration did."""

    loss: float
    applied: bool  # the optimizer step was taken and the loss is finite
    scaler_skip: bool = False  # not applied, but the fp16 loss scaler backed off: a normal skip


class Steps(Protocol):
    has_validation: bool
    save_without_progress: bool  # save at the end even when no iteration ran since the start

    def run(self, iteration: int) -> Outcome: ...
    def log(self, iteration: int, outcome: Outcome, elapsed_s: float) -> None: ...
    def evaluate(self, iteration: int) -> None: ...
    def save(self, iteration: int) -> None: ...
    def close(self) -> None: ...


def run_training(args, steps: Steps, iteration: int, features) -> list[tuple[int, float]]:
    """Iterations from `iteration` to --train-iters (or an exit); returns (iteration, loss)."""
    start_iteration, nan_streak, history = iteration, 0, []
    while iteration < args.train_iters:
        file_guard.check()  # a data file changed under the job: one line now, not a SIGBUS later
        features.begin_iteration(iteration)
        start = time.perf_counter()
        outcome = steps.run(iteration)
        nan_streak = 0 if (outcome.applied or outcome.scaler_skip) else nan_streak + 1
        if nan_streak >= args.max_nan_iterations:
            raise TrainingError(f"{nan_streak} NaN/inf iterations in a row at iteration {iteration + 1}: lower --lr, "
                                "check the data, or raise --max-nan-iterations")
        iteration += 1
        steps.log(iteration, outcome, time.perf_counter() - start)
        history.append((iteration, outcome.loss))
        features.end_iteration(iteration)
        if steps.has_validation and args.eval_iters > 0 and iteration % args.eval_interval == 0:
            features.eval_boundary()
            steps.evaluate(iteration)
            features.eval_boundary()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            steps.save(iteration)
        if args.exit_interval and iteration % args.exit_interval == 0:
            break
        if features.should_exit(iteration):  # exit signal or duration: the save below, then exit 0
            break
    features.finish()
    steps.close()
    just_saved = args.save_interval and iteration % args.save_interval == 0
    if args.save and not just_saved and (iteration > start_iteration or steps.save_without_progress):
        steps.save(iteration)
    return history

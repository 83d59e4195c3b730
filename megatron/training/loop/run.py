"""The training loop both paths share: iterate, stop on a NaN streak, evaluate, save, exit.

Why it exists: the static path (megatron-core's schedules) and the --dcp path (the
adaptive engine) differ in how one iteration runs, is logged, evaluated and saved, not
in the rules around it. Those rules are written once here; each path hands in a `Steps`
object with its own operations.

Evaluation as upstream Megatron-LM: every --eval-interval iterations (None: never during
training) the next --eval-iters global batches of the validation split (one pass walks on
through the split across evaluations, wrapping at its end); after a run that reached
--train-iters (not an exit), the validation and test splits once more, as
`iteration N on validation set` / `iteration N on test set`.
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


@dataclass(frozen=True)
class LoopConfig:
    """The loop's rules, read from the flags once (`flags.records.loop_config_for`)."""

    train_iters: int  # --train-iters (from --train-samples when given so)
    eval_interval: int | None = None  # --eval-interval: None, never during training
    eval_iters: int = 0  # --eval-iters: global batches per evaluation
    save_interval: int | None = None  # --save-interval
    saving: bool = False  # --save given
    exit_interval: int | None = None  # --exit-interval
    max_nan_iterations: int = 3  # --max-nan-iterations: NaN/inf iterations in a row that stop the run


class Steps(Protocol):
    has_validation: bool
    has_test: bool
    save_without_progress: bool  # save at the end even when no iteration ran since the start

    def run(self, iteration: int) -> Outcome: ...
    def log(self, iteration: int, outcome: Outcome, elapsed_s: float) -> None: ...
    def start_validation_at(self, batches: int) -> None: ...  # global batches taken before this start
    def evaluate(self, iteration: int, prefix: str, split: str = "valid") -> None: ...
    def save(self, iteration: int) -> None: ...
    def close(self) -> None: ...


def validation_batches_before(loop: LoopConfig, iteration: int) -> int:
    """The validation batches the evaluations up to `iteration` took: where a resumed run's
    pass goes on (upstream's count of consumed validation samples from the iteration)."""
    return (iteration // loop.eval_interval) * loop.eval_iters if loop.eval_interval else 0


def _evaluate(steps: Steps, features, iteration: int, prefix: str, split: str = "valid") -> None:
    features.eval_boundary()
    steps.evaluate(iteration, prefix, split)
    features.eval_boundary()


def run_training(loop: LoopConfig, steps: Steps, iteration: int, features) -> list[tuple[int, float]]:
    """Iterations from `iteration` to --train-iters (or an exit); returns (iteration, loss)."""
    start_iteration, nan_streak, history, exited = iteration, 0, [], False
    validating = steps.has_validation and loop.eval_iters > 0
    if validating:
        steps.start_validation_at(validation_batches_before(loop, iteration))
    while iteration < loop.train_iters:
        file_guard.check()  # a data file changed under the job: one line now, not a SIGBUS later
        features.begin_iteration(iteration)
        start = time.perf_counter()
        outcome = steps.run(iteration)
        nan_streak = 0 if (outcome.applied or outcome.scaler_skip) else nan_streak + 1
        if nan_streak >= loop.max_nan_iterations:
            raise TrainingError(f"{nan_streak} NaN/inf iterations in a row at iteration {iteration + 1}: lower --lr, "
                                "check the data, or raise --max-nan-iterations")
        iteration += 1
        steps.log(iteration, outcome, time.perf_counter() - start)
        history.append((iteration, outcome.loss))
        features.end_iteration(iteration)
        if validating and loop.eval_interval and iteration % loop.eval_interval == 0:
            _evaluate(steps, features, iteration, f"iteration {iteration}")
        if loop.saving and loop.save_interval and iteration % loop.save_interval == 0:
            steps.save(iteration)
        if loop.exit_interval and iteration % loop.exit_interval == 0:
            exited = True
            break
        if features.should_exit(iteration):  # exit signal or duration: the save below, then exit 0
            exited = True
            break
    steps.close()
    just_saved = loop.save_interval and iteration % loop.save_interval == 0
    if loop.saving and not just_saved and (iteration > start_iteration or steps.save_without_progress):
        steps.save(iteration)
    if not exited:  # as upstream: after the schedule's end (an exit leaves before), once more
        if validating:
            _evaluate(steps, features, iteration, f"iteration {iteration} on validation set")
        if steps.has_test and loop.eval_iters > 0:
            _evaluate(steps, features, iteration, f"iteration {iteration} on test set", split="test")
    features.finish()  # after the end-of-run evaluation: it still logs to --wandb-project
    return history

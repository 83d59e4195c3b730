"""Megatron's iteration log line, validation line and TensorBoard scalars.

The iteration line keeps upstream's fields and order so existing log parsers keep
working, and its `lm loss` is upstream's: the mean over the --log-interval window's
iterations that updated the model (the --loss-log file and TensorBoard keep each
iteration's); throughput counts causal attention per document (dcp_ext.planning.flops).
TensorBoard gets upstream's tags ('lm loss', 'learning-rate', 'batch-size', 'loss-scale',
'grad-norm', each also '... vs samples'), so existing dashboards keep working.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime

import torch.distributed as dist

from dcp_ext.planning.flops import training_flops
from megatron.training.initialize import print_rank_last


@dataclass(frozen=True)
class LogConfig:
    """What the log writes and where, read from the flags once (`flags.records.log_config_for`)."""

    train_iters: int = 0  # the line's "iteration N/train_iters"
    log_interval: int = 100  # --log-interval
    loss_log: str | None = None  # --loss-log: one JSON line per iteration
    tensorboard_dir: str | None = None
    tensorboard_queue_size: int = 1000
    tensorboard_log_interval: int = 1
    log_timers_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_throughput: bool = False
    wandb: bool = False  # --wandb-project given (LoopFeatures opens the run)
    model_shape: tuple[tuple[str, object], ...] = ()  # the model's dimensions, as training_flops takes them


class TrainingLogger:
    def __init__(self, config: LogConfig):
        self.config = config
        self.window_time = 0.0
        self.window_iters = 0
        self.window_flops = 0.0
        self.window_loss = 0.0  # lm loss summed over the window's iterations that updated
        self.window_advanced = 0
        self.skipped = 0
        self.nan = 0
        self.writer = None
        self.consumed_samples = 0
        self.last_rank = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        self.wandb = None
        if config.wandb and self.last_rank:
            import wandb  # validate_args checked it imports; LoopFeatures opened the run

            self.wandb = wandb
        if config.tensorboard_dir and self.last_rank:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)
            except ImportError:
                print_rank_last("warning: --tensorboard-dir given but tensorboard is not installed (pip install tensorboard)")

    def model_shape(self) -> dict:
        """The model's dimensions, as dcp_ext.planning.flops.training_flops takes them."""
        return dict(self.config.model_shape)

    def flops(self, doc_lengths) -> float:
        """Training FLOPs of these documents under this run's model."""
        return training_flops(doc_lengths, **self.model_shape())

    def log_iteration(self, iteration, consumed_samples, elapsed_s, losses, scheduler, optimizer, grad_norm,
                      update_successful, iteration_flops, global_batch_size, extra: str = "", record=None):
        """Accumulate one iteration; print Megatron's line every --log-interval iterations.

        `iteration_flops` is the whole job's work this iteration (every replica's documents
        once); TFLOP/s/GPU divides it by time and world size. `record`: extra fields for
        the --loss-log line.
        """
        loss = losses["lm loss"]
        if not update_successful:
            self.skipped += 1
        else:  # as upstream: the line's loss is the mean over the window's iterations that updated
            self.window_loss += loss
            self.window_advanced += 1
        if not math.isfinite(loss):
            self.nan += 1
        self.window_time += elapsed_s
        self.window_iters += 1
        self.window_flops += iteration_flops
        lr, decoupled_lr = _learning_rates(scheduler, optimizer)
        loss_scale = optimizer.get_loss_scale().item() if hasattr(optimizer, "get_loss_scale") else 1.0
        if self.config.loss_log and self.last_rank:
            record = {"iteration": iteration, "lm loss": loss, "grad norm": grad_norm, "lr": lr,
                      "consumed samples": consumed_samples, "skipped": not update_successful,
                      "loss scale": loss_scale, **({"decoupled lr": decoupled_lr} if decoupled_lr is not None else {}),
                      **(record or {})}
            with open(self.config.loss_log, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.consumed_samples = consumed_samples
        if (self.writer is not None or self.wandb is not None) and iteration % self.config.tensorboard_log_interval == 0:
            scalars = {"learning-rate": lr, "batch-size": global_batch_size, **losses, "loss-scale": loss_scale}
            if grad_norm is not None:
                scalars["grad-norm"] = grad_norm
            self._scalars(scalars, iteration, consumed_samples)
            if self.config.log_timers_to_tensorboard and self.writer is not None:
                self.writer.add_scalar("iteration-time", elapsed_s, iteration)
        if iteration % self.config.log_interval != 0:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        ms = 1000.0 * self.window_time / self.window_iters
        # every iteration of the window skipped (upstream then leaves the field out): the last loss
        mean_loss = self.window_loss / self.window_advanced if self.window_advanced else loss
        tflops = self.window_flops / max(self.window_time, 1e-12) / world / 1e12
        line = (
            f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
            f" iteration {iteration:8d}/{self.config.train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} |"
            + (f" throughput per GPU (TFLOP/s/GPU): {tflops:.3f} |" if self.config.log_throughput else "")
            + f" learning rate: {lr:.6E} |"
            + (f" decoupled learning rate: {decoupled_lr:.6E} |" if decoupled_lr is not None else "")
            + f" global batch size: {global_batch_size:5d} |"
            f" lm loss: {mean_loss:.6E} |"
            f" loss scale: {loss_scale:.1f} |"
            f" grad norm: {grad_norm if grad_norm is not None else float('nan'):.3f} |"
            f" number of skipped iterations: {self.skipped:3d} |"
            f" number of nan iterations: {self.nan:3d} |"
        )
        print_rank_last(line + extra)
        self.window_time, self.window_iters, self.window_flops = 0.0, 0, 0.0
        self.window_loss, self.window_advanced = 0.0, 0
        self.skipped = self.nan = 0

    def log_validation(self, iteration, loss, prefix: str | None = None, scalars: bool = True):
        """Upstream's validation block: ` validation loss at <prefix> | lm loss value: ... |
        lm loss PPL: ... | ` between two dash lines one longer than it. `prefix`: `iteration N`
        (the default), or `iteration N on validation set` / `... on test set` at the end.
        `scalars`: also to TensorBoard/W&B as 'lm loss validation' (not for the test set)."""
        ppl = math.exp(min(20.0, loss))
        line = (f" validation loss at {prefix or f'iteration {iteration}'} | "
                f"lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | ")
        print_rank_last("-" * (len(line) + 1))
        print_rank_last(line)
        print_rank_last("-" * (len(line) + 1))
        if scalars and (self.writer is not None or self.wandb is not None):
            values = {"lm loss validation": loss}
            if self.config.log_validation_ppl_to_tensorboard:
                values["lm loss validation ppl"] = ppl
            self._scalars(values, iteration, self.consumed_samples)

    def _scalars(self, scalars: dict, iteration: int, consumed_samples: int) -> None:
        """Each value against the iteration and, as '<tag> vs samples', against the
        samples consumed (Megatron's TensorBoard tags)."""
        for tag, value in scalars.items() if self.writer is not None else ():
            self.writer.add_scalar(tag, value, iteration)
            self.writer.add_scalar(f"{tag} vs samples", value, consumed_samples)
        if self.wandb is not None:  # --wandb-project: the same scalars
            self.wandb.log(scalars, step=iteration)

    def close(self):
        if self.writer is not None:
            self.writer.close()




def _learning_rates(scheduler, optimizer):
    """(lr, decoupled lr or None): the first ordinary param group's LR, and the embedding/output
    layer's under --decoupled-lr (megatron-core marks a group with its own LR schedule
    `default_config: False`; older versions `is_decoupled_lr`)."""
    if not hasattr(scheduler, "get_lr"):
        return float("nan"), None
    lr = decoupled = None
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr") or group.get("default_config") is False:
            decoupled = decoupled if decoupled is not None else scheduler.get_lr(group)
        elif lr is None:
            lr = scheduler.get_lr(group)
    return (lr if lr is not None else float("nan")), decoupled

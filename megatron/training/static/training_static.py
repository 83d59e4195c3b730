"""The static layout's step kind: megatron-core's model, DDP, optimizer and schedules.

Why it exists: `pretrain()` (training.py) sets both step kinds up in one order and hands
the loop (`loop.run`) a `Steps` object; this is the one for a fixed TP/PP/CP/DP layout
(the other is `adaptive.training_adaptive`). It drives megatron-core exactly as upstream
Megatron does, with the loss per token over the whole global batch (docs/contracts.md,
"Loss"). It reads no flags: the door builds its `StaticOptions` (`flags.records.static_options_for`).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from megatron.training import checkpointing
from megatron.training.checkpoint import finite_weights
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.initialize import initialize_model_parallel, set_random_seed
from megatron.training.loop.batch_schedule import GlobalBatchSizes
from megatron.training.loop.batches import Packing, collate_fixed_length
from megatron.training.loop.data_workers import WorkerBatches
from megatron.training.loop.loop_features import LoopFeatures
from megatron.training.loop.run import Outcome


@dataclass(frozen=True)
class StaticOptions:
    """What the static step kind needs of the run, read from the flags once (after the
    tokenizer: the vocabulary is padded). megatron-core's own configs are built at the door
    too (`flags.core_configs`)."""

    tp: int
    pp: int
    cp: int
    timeout_minutes: int  # --distributed-timeout-minutes: every process group's
    seed: int
    half: bool  # --bf16 or --fp16: the model in half precision (Float16Module)
    micro_batch_size: int
    batch_sizes: GlobalBatchSizes
    seq_length: int
    lr_schedule_in_samples: bool  # a batch-size schedule steps it by each iteration's samples
    eval_iters: int
    eval_microbatches: int  # micro-batches of one --global-batch-size on this DP rank
    num_workers: int  # --num-workers: DataLoader workers read the samples ahead
    packing: Packing
    checkpoint: CheckpointConfig
    model_config: Any  # megatron-core's TransformerConfig
    ddp_config: Any  # megatron-core's DistributedDataParallelConfig
    optimizer_config: Any  # megatron-core's OptimizerConfig


def build_model_and_optimizer(options: StaticOptions, model_provider: Callable):
    """The model stage this rank holds, wrapped in megatron-core DDP, with its optimizer.

    As upstream's `get_model`: under --bf16/--fp16 the model is wrapped in `Float16Module`
    (every parameter and buffer in half precision, first-stage inputs cast to it, last-stage
    outputs back to fp32); DDP keeps fp32 main grads when `--accumulate-allreduce-grads-in-fp32`
    (implied by --bf16), and the optimizer keeps fp32 master weights (and, under --fp16, the
    dynamic loss scaler).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = options.model_config
    pre_process = parallel_state.is_pipeline_first_stage()
    post_process = parallel_state.is_pipeline_last_stage()
    model = model_provider(config, pre_process=pre_process, post_process=post_process)
    if torch.cuda.is_available():  # as upstream's get_model: weights drawn on the CPU move to the GPU
        model.cuda(torch.cuda.current_device())
    if options.half:
        model = Float16Module(config, model)
    model = DistributedDataParallel(config=config, ddp_config=options.ddp_config, module=model)
    optimizer = get_megatron_optimizer(options.optimizer_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = partial(finalize_already_per_token, finalize_model_grads)
    config.no_sync_func = model.no_sync
    return model, optimizer, config


def finalize_already_per_token(finalize, model, num_tokens=None, *args, **kwargs):
    """megatron-core's finalize_model_grads without its division by the token count: the loss
    was divided by the global batch's loss tokens before the backward (`per_global_token`)."""
    return finalize(model, None, *args, **kwargs)


def per_global_token(forward_step_func: Callable, loss_tokens: float) -> Callable:
    """The user's forward step with its loss divided by the global batch's loss-token count
    before the backward (docs/contracts.md, "Loss": a constant known before the iteration).

    megatron-core's per-token rule back-propagates each micro-batch's loss *sum* and divides
    the gradients by the token count after the backward; under --fp16 a constant loss scale
    sized for a mean (upstream's 8192) then overflows the half-precision gradients by the
    token count (every step skipped, grad norm nan). Dividing first keeps the gradients a
    mean's size, as upstream's averaged loss has them; the reported loss is untouched."""
    def step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def loss_per_global_token(output_tensor):
            loss, num_tokens, report = loss_func(output_tensor)
            return loss / loss_tokens, num_tokens, report

        return output, loss_per_global_token

    return step


def global_loss_tokens(batches) -> float:
    """The global batch's loss tokens: this rank's share (its CP chunk of its DP rank's
    micro-batches, counted on the host) summed over the DP x CP ranks, over gloo: no wait for
    the device."""
    from megatron.core import parallel_state

    mine = torch.tensor([float(sum(float(b["loss_mask"].sum()) for b in batches))], dtype=torch.float64)
    dist.all_reduce(mine, group=parallel_state.get_data_parallel_group_gloo(with_context_parallel=True))
    return max(float(mine.item()), 1.0)


def attach_timers(config, optimizer, timers) -> None:
    """--timing-log-level: megatron-core's schedules and optimizer time themselves through these."""
    if timers is None:
        return
    config.timers = timers
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt.config.timers = timers


class StaticRun:
    """The static layout's parts: megatron-core's model parallel state, model, DDP and optimizer."""

    def __init__(self, options: StaticOptions, datasets: Callable[[], tuple], model_provider, forward_step_func):
        """`datasets()`: the (train, valid, test) datasets (the entry script's provider)."""
        self.options, self.datasets = options, datasets
        self.model_provider, self.forward_step_func = model_provider, forward_step_func

    def seed(self) -> None:
        o = self.options
        initialize_model_parallel(o.tp, o.pp, o.cp, o.timeout_minutes)
        set_random_seed(o.seed)

    def data(self) -> None:
        self.train_ds, self.valid_ds, self.test_ds = self.datasets()

    def build(self, peak_memory):
        self.model, self.optimizer, self.config = build_model_and_optimizer(self.options, self.model_provider)
        return self.optimizer

    def load(self, scheduler) -> tuple[int, int]:
        return checkpointing.load_checkpoint(self.options.checkpoint, self.model, self.optimizer, scheduler)

    def steps(self, scheduler, consumed_samples: int, logger, features) -> "StaticSteps":
        self.model.train()
        attach_timers(self.config, self.optimizer, features.timers)
        return StaticSteps(self.options, self.model, self.optimizer, scheduler, self.config, self.forward_step_func,
                           self.train_ds, self.valid_ds, consumed_samples, logger, features, test_ds=self.test_ds)

    def finish(self) -> None:
        pass


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                  data_parallel_size: int, collate, global_batch_size: int):
    """Micro-batches of one global batch (--global-batch-size, or a batch-size schedule's
    size) for this DP rank, Megatron's sample order."""
    mbs = micro_batch_size
    step = mbs * data_parallel_size
    for m in range(global_batch_size // step):
        start = consumed_samples + m * step + data_parallel_rank * mbs
        yield collate([dataset[(start + i) % len(dataset)] for i in range(mbs)])


def train_step(model, optimizer, scheduler, config, forward_step_func, data_iterator, num_microbatches: int,
               seq_length: int, micro_batch_size: int, lr_increment: int = 1, forward_only: bool = False,
               features: Optional[LoopFeatures] = None, iteration: Optional[int] = None,
               flops: float | None = None):
    """One forward/backward over `num_microbatches`, then (unless forward_only) one optimizer
    step. `flops`: this rank's share of the model FLOPs, summed over ranks with the loss.
    `lr_increment`: the scheduler's step (1, or the samples of the iteration under --train-samples)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        batches = list(data_iterator)  # the global batch's divisor is known before its first backward
        forward_step_func = per_global_token(forward_step_func, global_loss_tokens(batches))
        data_iterator = iter(batches)
    losses = get_forward_backward_func()(  # times 'forward-backward' itself (config.timers)
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    update_successful, grad_norm = True, None
    if not forward_only:
        finite_weights.inject_nan_grad(model.parameters(), iteration)
        with features.timer("optimizer") if features else nullcontext():
            # a step whose gradient norm is NaN/inf is skipped, not applied (as under --dcp)
            update_successful, grad_norm, _ = mcore_compat.step_unless_gradients_nonfinite(optimizer)
        finite_weights.inject_nan_weights(model.parameters(), iteration)
        if update_successful:
            scheduler.step(increment=lr_increment)
    return reduce_losses(losses, model_device(model), flops), update_successful, grad_norm


def reduce_losses(losses, device, flops: float | None = None) -> dict[str, float]:
    """Sum each reported (loss_sum, tokens) over micro-batches and DP/CP ranks; per-token means.

    Only the last pipeline stage holds losses (the others send zeros, on the model's
    `device`: NCCL reduces device tensors only); the result is broadcast over the pipeline
    so every rank returns the same numbers, read on the host once. `flops`: this rank's
    share of the iteration's model FLOPs, summed in the same reduction (key "flops").
    """
    from megatron.core import parallel_state

    from dcp_ext.runtime.host_device import values_on_device

    totals: dict[str, torch.Tensor] = {}
    for entry in losses or []:
        for key, value in entry.items():
            totals[key] = totals.get(key, 0) + value.detach().double()
    keys = ["lm loss"]
    zeros = torch.zeros(2, dtype=torch.float64, device=device)
    rows = [totals.get(k, zeros).to(device) for k in keys]
    if flops is not None:
        rows.append(values_on_device([flops, 0.0], device))
    vec = torch.stack(rows)
    dist.all_reduce(vec, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(vec, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    vec = vec.cpu()
    out = {k: (vec[i, 0] / vec[i, 1].clamp(min=1)).item() for i, k in enumerate(keys)}
    if flops is not None:
        out["flops"] = vec[len(keys), 0].item()
    return out


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def loss_scaler_can_back_off(optimizer) -> bool:
    """Whether every (chained) optimizer has a dynamic loss scaler still above its minimum."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    scalers = [getattr(opt, "grad_scaler", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return bool(scalers) and all(
        isinstance(s, DynamicGradScaler) and bool((s.scale > s.min_scale).all()) for s in scalers
    )


class StaticSteps:
    """One iteration of the static layout: megatron-core's schedule over this DP rank's
    micro-batches, Megatron's sample order."""

    save_without_progress = True

    def __init__(self, options: StaticOptions, model, optimizer, scheduler, config, forward_step_func, train_ds,
                 valid_ds, consumed_samples, logger, features, test_ds=None):
        from megatron.core import parallel_state

        self.options, self.model, self.optimizer, self.scheduler = options, model, optimizer, scheduler
        self.config, self.forward_step_func, self.logger, self.features = config, forward_step_func, logger, features
        self.train_ds, self.valid_ds, self.consumed_samples = train_ds, valid_ds, consumed_samples
        self.has_validation = valid_ds is not None
        self.test_ds, self.has_test = test_ds, test_ds is not None
        self.consumed_valid_samples = 0  # the validation pass walks on from here (wrapping at the split's end)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.collate = partial(collate_fixed_length, packing=options.packing)
        self.workers = None  # --num-workers: started at the first iteration (its batch sizes follow from it)
        self.batches, self.losses, self.grad_norm = [], {}, None
        self.global_batch_size = options.batch_sizes.size  # this iteration's (a --step-batch-size-schedule's)

    def run(self, iteration: int) -> Outcome:
        o = self.options
        self.global_batch_size = gbs = o.batch_sizes.of_iteration(iteration)  # a --step-batch-size-schedule's
        if o.num_workers and self.workers is None:
            self.workers = WorkerBatches(self.train_ds, self.consumed_samples, o.micro_batch_size, o.batch_sizes,
                                         o.num_workers, self.dp_rank, self.dp_size, self.collate,
                                         first_iteration=iteration)
        self.batches = self.workers.next_global_batch(gbs) if self.workers else list(
            micro_batches(self.train_ds, self.consumed_samples, o.micro_batch_size, self.dp_rank, self.dp_size,
                          self.collate, gbs))
        # this DP rank's documents (every CP rank holds them whole): their FLOPs, summed over
        # the DP x CP group with the loss
        share = self.logger.flops([n for b in self.batches for n in b["doc_lengths"]]) / self.cp_size
        self.losses, ok, self.grad_norm = train_step(
            self.model, self.optimizer, self.scheduler, self.config, self.forward_step_func, iter(self.batches),
            gbs // (o.micro_batch_size * self.dp_size), o.seq_length, o.micro_batch_size,
            lr_increment=gbs if o.lr_schedule_in_samples else 1, features=self.features, iteration=iteration + 1,
            flops=share)
        self.flops = self.losses.pop("flops")
        loss = self.losses["lm loss"]
        self.consumed_samples += gbs
        # An overflow that the dynamic loss scaler (--fp16) answers by backing off is a normal
        # skipped iteration, as in Megatron; it is a NaN/inf iteration once the scale is at its floor.
        finite = math.isfinite(loss)
        return Outcome(loss, ok and finite, finite and not ok and loss_scaler_can_back_off(self.optimizer))

    def log(self, iteration: int, outcome: Outcome, elapsed_s: float) -> None:
        self.logger.log_iteration(iteration, self.consumed_samples, elapsed_s, self.losses, self.scheduler,
                                  self.optimizer, self.grad_norm, outcome.applied, self.flops,
                                  self.global_batch_size)

    def start_validation_at(self, batches: int) -> None:
        self.consumed_valid_samples = batches * self.options.batch_sizes.size

    def evaluate(self, iteration: int, prefix: str, split: str = "valid") -> None:
        """The next --eval-iters global batches of the validation split, or (split 'test')
        the test split's first ones, as upstream's iterators give them."""
        test = split == "test"
        dataset, start = (self.test_ds, 0) if test else (self.valid_ds, self.consumed_valid_samples)
        evaluate_and_log(self.options, self.model, self.forward_step_func, dataset, start, self.collate, self.dp_rank,
                         self.dp_size, self.logger, iteration, prefix, scalars=not test)
        if not test:
            self.consumed_valid_samples += self.options.eval_iters * self.options.batch_sizes.size

    def save(self, iteration: int) -> None:
        checkpointing.save_checkpoint(self.options.checkpoint, iteration, self.consumed_samples, self.model, self.optimizer,
                                      self.scheduler)

    def close(self) -> None:
        if self.workers:
            self.workers.close()


def evaluate_and_log(options: StaticOptions, model, forward_step_func, dataset, consumed_samples: int, collate, dp_rank: int,
                     dp_size: int, logger, iteration: int, prefix: str, scalars: bool = True) -> float:
    """The per-token loss (as upstream: over every token of the pass) of --eval-iters global
    batches of `dataset` from `consumed_samples` on, forward only; logged as upstream's block."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    reported = []
    with torch.no_grad():
        gbs = options.batch_sizes.size
        for i in range(options.eval_iters):
            batches = list(micro_batches(dataset, consumed_samples + i * gbs, options.micro_batch_size, dp_rank,
                                         dp_size, collate, gbs))
            reported += get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=iter(batches), model=[model],
                num_microbatches=options.eval_microbatches, seq_length=options.seq_length,
                micro_batch_size=options.micro_batch_size, forward_only=True) or []
    model.train()
    loss = reduce_losses(reported, model_device(model))["lm loss"]
    logger.log_validation(iteration, loss, prefix, scalars=scalars)
    return loss

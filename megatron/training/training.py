"""`pretrain()`: Megatron's training loop on megatron-core parts, CPU (gloo) or GPU (NCCL).

A static layout (TP/PP/CP/DP fixed for the run) drives megatron-core's model, DDP,
optimizer, LR schedule and forward/backward schedules exactly as upstream Megatron does.
`--dcp` hands the per-iteration work to the adaptive runtime in `dcp_ext.runtime`.
Loss is per token over the whole global batch (docs/contracts.md, "Loss").
"""
from __future__ import annotations

import math
import os
import sys
from contextlib import nullcontext
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from megatron.training import checkpointing, global_vars
from megatron.training.checkpoint import finite_weights
from megatron.training.startup import preflight
from megatron.training.loop.loop_features import LoopFeatures
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.flags.records import (batch_sizes_for, checkpoint_config_for, feature_options_for,
                                             log_config_for, loop_config_for, memory_budget_for, model_parallel_for,
                                             output_paths_for, packing_for)
from megatron.training.initialize import (
    initialize_distributed,
    shutdown_distributed,
    initialize_model_parallel,
    print_rank_0,
    set_random_seed,
)
from megatron.training.loop.data_workers import WorkerBatches
from megatron.training.errors import AgreedTrainingError, TrainingError
from megatron.training.loop.log import TrainingLogger
from megatron.training.loop.run import Outcome, run_training
from megatron.training.flags.core_configs import (build_lr_scheduler, dtype_of, optimizer_config_from_args,  # noqa: F401
                                                  transformer_config_from_args)
from megatron.training.loop.memory_report import report_memory, start_memory_report
from megatron.training.adaptive.training_adaptive import AdaptiveRun


def build_model_and_optimizer(args, model_provider: Callable):
    """The model stage this rank holds, wrapped in megatron-core DDP, with its optimizer.

    As upstream's `get_model`: under --bf16/--fp16 the model is wrapped in `Float16Module`
    (every parameter and buffer in half precision, first-stage inputs cast to it, last-stage
    outputs back to fp32); DDP keeps fp32 main grads when `--accumulate-allreduce-grads-in-fp32`
    (implied by --bf16), and the optimizer keeps fp32 master weights (and, under --fp16, the
    dynamic loss scaler).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = transformer_config_from_args(args)
    pre_process = parallel_state.is_pipeline_first_stage()
    post_process = parallel_state.is_pipeline_last_stage()
    model = model_provider(config, pre_process=pre_process, post_process=post_process)
    if torch.cuda.is_available():  # as upstream's get_model: weights drawn on the CPU move to the GPU
        model.cuda(torch.cuda.current_device())
    if args.fp16 or args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), [model])
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


QUIET_RANK_GRACE_S = 5.0  # how long a rank that does not print an error waits for rank 0 to print it


def _report_error_and_exit(message: str, code: int = 1, every_rank: bool = True) -> None:
    """One line on stderr and a non-zero exit. Errors every rank meets alike (flags) print once."""
    import os

    def env_int(name: str, default: int) -> int:  # the environment may be what is wrong
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    speaks = every_rank or rank == 0 or not 0 <= rank < world
    from megatron.training.startup import liveness

    liveness.stop(message)  # peers that lose contact with this rank quote why it stopped
    if speaks:
        names_its_rank = message.startswith(f"rank {rank} ")
        prefix = f"[rank {rank}] " if every_rank and world > 1 and not names_its_rank else ""
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    from megatron.training.startup import stop_signals

    stop_signals.reason_given()
    if not speaks:
        # a silent rank that exits first makes torchrun stop rank 0 (SIGTERM) before it
        # prints the line: leave rank 0 the time to print and exit first (torchrun then
        # stops this rank, silently: its reason is given)
        import time

        time.sleep(QUIET_RANK_GRACE_S)
    sys.exit(code)


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    argv: Optional[list[str]] = None,
    document_datasets_provider: Optional[Callable] = None,
):
    """Megatron's entry: parse flags, initialise, build, (resume), train, evaluate, save.

    `document_datasets_provider(args)` gives one-document-per-sample datasets for `--dcp`.
    Returns the list of (iteration, lm loss) logged, for tests and tools.
    """
    from dcp_ext.data.errors import DataError
    from dcp_ext.planning.planners.errors import PlanningError

    try:
        args = parse_args(argv)
    except ArgumentError as e:
        _report_error_and_exit(str(e), 2, every_rank=False)
    global_vars.set_args(args)
    from megatron.training.startup import stop_signals

    stop_signals.say_why_on_sigterm()  # a rank stopped by torchrun says so in one line
    try:
        logged = _pretrain(args, train_valid_test_datasets_provider, model_provider, forward_step_func,
                           document_datasets_provider)
        from megatron.training.startup import liveness

        liveness.stop("finished")  # peers will not take this rank's silence for a stall
        shutdown_distributed()
        return logged
    except (DataError, TrainingError, checkpointing.CheckpointError, ArgumentError, PlanningError) as e:
        _report_error_and_exit(str(e), getattr(e, "exit_code", 1), every_rank=not isinstance(e, AgreedTrainingError))
    except RuntimeError as e:
        if not _is_lost_peer(e):
            _report_os_error_or_raise(e, args)
        _report_collective_fault(e, args)
    except KeyboardInterrupt:  # SIGINT, Ctrl-C: one line, as SIGTERM ends without --exit-signal-handler
        from megatron.training.startup import liveness

        if liveness.launcher_stop_line():  # the heartbeat stopped this rank: its launcher is gone (line said)
            sys.exit(1)
        _report_error_and_exit(interrupted_message(args), 130, every_rank=False)
    except BaseException as e:  # an OSError (full disk, permissions), or torch's CheckpointException wrapping one
        from megatron.training.startup.collective_faults import find_collective_failure

        inner = find_collective_failure(e) if not isinstance(e, (SystemExit, KeyboardInterrupt)) else None
        if inner is not None:  # a save whose collective failed because of a peer
            _report_collective_fault(inner, args)
        _report_os_error_or_raise(e, args)
    finally:
        from megatron.training.checkpoint import lock as checkpoint_lock

        checkpoint_lock.release()  # the --save lock, however the run ends (a no-op where none is held)


def interrupted_message(args=None) -> str:
    """What a SIGINT (Ctrl-C) stopped, and where the run can resume."""
    from megatron.training.checkpoint.protocol import TRACKER

    save = args.save if args is not None else None
    if not save:
        return "interrupted (SIGINT, Ctrl-C): the run stopped; it saved nothing (no --save)"
    try:
        with open(os.path.join(save, TRACKER)) as f:
            last = f.read().strip()
    except OSError:
        last = None
    where = f"its last checkpoint in --save {save} is iteration {last}" if last else f"nothing is saved in --save {save} yet"
    return (f"interrupted (SIGINT, Ctrl-C): the run stopped; {where}: rerun with the same flags to resume "
            "(--exit-signal-handler saves before stopping)")


def _report_os_error_or_raise(e: BaseException, args=None) -> None:
    """A failure of the operating system (full disk, read-only path) is one line; anything else propagates."""
    from megatron.training.startup.os_errors import explain_failure

    if isinstance(e, (SystemExit, KeyboardInterrupt)):
        raise e
    line = explain_failure(e, output_paths_for(args) if args is not None else ())
    if line is None:
        raise e
    _report_error_and_exit(line)


def _is_lost_peer(e: BaseException) -> bool:
    """A collective failed because a peer died, hangs or stopped (gloo/NCCL), not a bug of this rank."""
    from megatron.training.startup.collective_faults import is_collective_failure

    return is_collective_failure(e)


def _report_collective_fault(e: BaseException, args) -> None:
    """One line naming the rank that stopped answering and the collective (collective_faults),
    worked out while a SIGTERM from torchrun waits; then exit 1."""
    from megatron.training.startup import collective_faults

    with collective_faults.sigterm_deferred():
        try:
            line = collective_faults.fault_line(e, args.distributed_timeout_minutes)
        except Exception:  # noqa: BLE001  (the diagnosis must never hide the fault behind its own traceback)
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            line = (f"lost contact with another rank ({first}): it died, hangs or stopped; see every rank's log, "
                    "then rerun to resume from the last checkpoint")
        _report_error_and_exit(line)


def _pretrain(args, datasets_provider, model_provider, forward_step_func, document_datasets_provider=None):
    initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    from megatron.training.startup import job_agreement, liveness

    liveness.start(dist.get_rank(), dist.get_world_size())  # heartbeats: who stopped answering, if one does

    job_agreement.check(args, print_rank_0)  # every rank was given the same flags; where one-rank outputs go
    from megatron.training.flags.upstream_flags import announce

    announce(args, print_rank_0)  # the upstream flags accepted without effect, once, on rank 0
    preflight.check_output_paths(output_paths_for(args))  # both paths (static, --dcp): every output writable, before any work
    from megatron.training.checkpoint import lock as checkpoint_lock

    checkpoint_lock.acquire(args.save)  # one job per --save: rank 0 takes its lock, or every rank stops here
    from megatron.training.flags.model_flags import startup_notes

    for note in startup_notes(args):  # what the model/kernel/precision flags do on this machine
        print_rank_0(f"> {note}")
    global_vars.build_tokenizer(args)
    if args.dcp:
        if document_datasets_provider is None:
            raise ArgumentError("--dcp needs a document_datasets_provider (one document per sample)")
        run = AdaptiveRun(args, document_datasets_provider, model_provider, forward_step_func)
    else:
        run = StaticRun(args, datasets_provider, model_provider, forward_step_func)
    return train_run(args, run)


def train_run(args, run) -> list:
    """Both ways to train, set up in one order: seed, data (and, adaptive, the plan's
    vocabulary and planner), the memory report from here on, the model and optimizer (the
    engine), the LR schedule, the checkpoint, then the loop. `run` is the seam between the
    static layout (`StaticRun`) and the adaptive runtime (`training_adaptive.AdaptiveRun`)."""
    run.seed()
    run.data()
    budget = memory_budget_for(args)
    peak_memory = start_memory_report(budget)  # every rank's peak from here on, said after training
    optimizer = run.build(peak_memory)
    scheduler = build_lr_scheduler(args, optimizer)
    iteration, consumed_samples = run.load(scheduler) if args.load else (0, 0)
    logger = TrainingLogger(log_config_for(args))
    features = LoopFeatures(feature_options_for(args))
    steps = run.steps(scheduler, consumed_samples, logger, features)
    history = run_training(loop_config_for(args), steps, iteration, features)
    run.finish()
    report_memory(budget, peak_memory)
    logger.close()
    dist.barrier()
    return history


class StaticRun:
    """The static layout's parts: megatron-core's model parallel state, model, DDP and optimizer."""

    def __init__(self, args, datasets_provider, model_provider, forward_step_func):
        self.args, self.datasets_provider = args, datasets_provider
        self.model_provider, self.forward_step_func = model_provider, forward_step_func

    def seed(self) -> None:
        initialize_model_parallel(**model_parallel_for(self.args))
        set_random_seed(self.args.seed)

    def data(self) -> None:
        self.train_ds, self.valid_ds, self.test_ds = self.datasets_provider(self.args)

    def build(self, peak_memory):
        self.model, self.optimizer, self.config = build_model_and_optimizer(self.args, self.model_provider)
        self.checkpointing = checkpoint_config_for(self.args)  # the vocabulary is padded by now
        return self.optimizer

    def load(self, scheduler) -> tuple[int, int]:
        return checkpointing.load_checkpoint(self.checkpointing, self.model, self.optimizer, scheduler)

    def steps(self, scheduler, consumed_samples: int, logger, features) -> "StaticSteps":
        self.model.train()
        attach_timers(self.config, self.optimizer, features.timers)
        return StaticSteps(self.args, self.model, self.optimizer, scheduler, self.config, self.forward_step_func,
                           self.train_ds, self.valid_ds, consumed_samples, logger, features, test_ds=self.test_ds,
                           checkpointing=self.checkpointing)

    def finish(self) -> None:
        pass


def micro_batches(dataset, consumed_samples: int, args, data_parallel_rank: int, data_parallel_size: int, collate,
                  global_batch_size: Optional[int] = None):
    """Micro-batches of one global batch (--global-batch-size, or the size given: a batch-size
    schedule's) for this DP rank, Megatron's sample order."""
    mbs = args.micro_batch_size
    step = mbs * data_parallel_size
    for m in range((global_batch_size or args.global_batch_size) // step):
        start = consumed_samples + m * step + data_parallel_rank * mbs
        yield collate([dataset[(start + i) % len(dataset)] for i in range(mbs)])


def train_step(args, model, optimizer, scheduler, config, forward_step_func, data_iterator, num_microbatches,
               seq_length: int, forward_only: bool = False, features: Optional[LoopFeatures] = None,
               iteration: Optional[int] = None, flops: float | None = None, lr_increment: Optional[int] = None):
    """One forward/backward over `num_microbatches`, then (unless forward_only) one optimizer
    step. `flops`: this rank's share of the model FLOPs, summed over ranks with the loss.
    `lr_increment`: the scheduler's step (default `args.lr_step_increment`)."""
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
        micro_batch_size=args.micro_batch_size,
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
            scheduler.step(increment=lr_increment or args.lr_step_increment)
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

    def __init__(self, args, model, optimizer, scheduler, config, forward_step_func, train_ds, valid_ds,
                 consumed_samples, logger, features, test_ds=None, checkpointing=None):
        from megatron.core import parallel_state

        from megatron.training.loop.batches import collate_fixed_length

        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.config, self.forward_step_func, self.logger, self.features = config, forward_step_func, logger, features
        self.train_ds, self.valid_ds, self.consumed_samples = train_ds, valid_ds, consumed_samples
        self.checkpointing = checkpointing  # a CheckpointConfig: what save() writes where
        self.has_validation = valid_ds is not None
        self.test_ds, self.has_test = test_ds, test_ds is not None
        self.consumed_valid_samples = 0  # the validation pass walks on from here (wrapping at the split's end)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.collate = partial(collate_fixed_length, packing=packing_for(args))
        self.batch_sizes = batch_sizes_for(args)
        self.workers = None  # --num-workers: started at the first iteration (its batch sizes follow from it)
        self.batches, self.losses, self.grad_norm = [], {}, None
        self.global_batch_size = args.global_batch_size  # this iteration's (a --step-batch-size-schedule's)

    def run(self, iteration: int) -> Outcome:
        args = self.args
        self.global_batch_size = gbs = self.batch_sizes.of_iteration(iteration)  # a --step-batch-size-schedule's
        if args.num_workers and self.workers is None:
            self.workers = WorkerBatches(self.train_ds, self.consumed_samples, args.micro_batch_size, self.batch_sizes,
                                         args.num_workers, self.dp_rank, self.dp_size, self.collate,
                                         first_iteration=iteration)
        self.batches = self.workers.next_global_batch(gbs) if self.workers else list(
            micro_batches(self.train_ds, self.consumed_samples, args, self.dp_rank, self.dp_size, self.collate, gbs))
        # this DP rank's documents (every CP rank holds them whole): their FLOPs, summed over
        # the DP x CP group with the loss
        share = self.logger.flops([n for b in self.batches for n in b["doc_lengths"]]) / self.cp_size
        self.losses, ok, self.grad_norm = train_step(
            args, self.model, self.optimizer, self.scheduler, self.config, self.forward_step_func, iter(self.batches),
            gbs // (args.micro_batch_size * self.dp_size), args.seq_length, features=self.features,
            iteration=iteration + 1, flops=share, lr_increment=gbs if args.lr_schedule_in_samples else 1)
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
        self.consumed_valid_samples = batches * self.args.global_batch_size

    def evaluate(self, iteration: int, prefix: str, split: str = "valid") -> None:
        """The next --eval-iters global batches of the validation split, or (split 'test')
        the test split's first ones, as upstream's iterators give them."""
        test = split == "test"
        dataset, start = (self.test_ds, 0) if test else (self.valid_ds, self.consumed_valid_samples)
        evaluate_and_log(self.args, self.model, self.forward_step_func, dataset, start, self.collate, self.dp_rank,
                         self.dp_size, self.logger, iteration, prefix, scalars=not test)
        if not test:
            self.consumed_valid_samples += self.args.eval_iters * self.args.global_batch_size

    def save(self, iteration: int) -> None:
        checkpointing.save_checkpoint(self.checkpointing, iteration, self.consumed_samples, self.model, self.optimizer,
                                      self.scheduler)

    def close(self) -> None:
        if self.workers:
            self.workers.close()


def evaluate_and_log(args, model, forward_step_func, dataset, consumed_samples: int, collate, dp_rank: int,
                     dp_size: int, logger, iteration: int, prefix: str, scalars: bool = True) -> float:
    """The per-token loss (as upstream: over every token of the pass) of --eval-iters global
    batches of `dataset` from `consumed_samples` on, forward only; logged as upstream's block."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    reported = []
    with torch.no_grad():
        for i in range(args.eval_iters):
            batches = list(micro_batches(dataset, consumed_samples + i * args.global_batch_size, args, dp_rank,
                                         dp_size, collate))
            reported += get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=iter(batches), model=[model],
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True) or []
    model.train()
    loss = reduce_losses(reported, model_device(model))["lm loss"]
    logger.log_validation(iteration, loss, prefix, scalars=scalars)
    return loss

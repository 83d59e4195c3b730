"""The adaptive engine: one training step under whatever layout the plan names.

It builds three owners once and runs a step through them:
- `stages.StageBank`: process groups of every replica type, this rank's megatron-core stage
  in each (and layer-wise alternatives), all viewing two shared buffers;
- `params.ParameterServer`: the canonical space's fixed sharding, the optimizer on this
  rank's shard, the exchange that pulls parameters into a layout and pushes gradients back;
- `schedule`: how the replica's micro-batches run (1F1B over its stages, THD, CP).
A step: resolve this rank's part of the plan (`LocalPlan`), pull its stage's parameters
(bucket by bucket, overlapped with the forward when asked), run the micro-batches with
fp32 main grads, push each bucket's gradients to their owners as soon as the last
backward has produced them, then clip and update the shard (fp16: unscale, skip on
overflow, Megatron's dynamic loss scaler). Every tensor lives on the model's device, and
a step waits for the device twice: once for its timings (`DeviceClock.seconds`), once to
read the loss and gradient norm (`_reduce`), which decide the update.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from dcp_ext.data.thd import num_loss_tokens
from dcp_ext.planning.layout import ReplicaType
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.runtime.device_clock import DeviceClock
from dcp_ext.runtime.host_device import values_on_device
from dcp_ext.runtime.local_plan import LocalPlan
from dcp_ext.runtime.options import EngineOptions, default_device
from dcp_ext.runtime.params.initial_values import seed_rng_tracker
from dcp_ext.runtime.params.server import ParameterServer
from dcp_ext.runtime.params.streams import WAIT
from dcp_ext.runtime.schedule.timing import LocalTimings, untimed
from dcp_ext.runtime.stages.bank import StageBank
from dcp_ext.runtime.step_result import NoTrainableTokens, StepResult

EXCHANGE = "exchange"  # the device clock's key for a pull or push not overlapped with compute


class AdaptiveEngine:
    def __init__(self, replica_types: Sequence[ReplicaType], make_config: Callable, build_model: Callable,
                 options: EngineOptions = EngineOptions(), grad_scaler=None, forward_step: Callable | None = None):
        """make_config(tp, cp, pp, sequence_parallel) -> TransformerConfig;
        build_model(config, pre_process, post_process, pg_collection) -> GPTModel stage;
        grad_scaler: megatron-core's loss scaler under fp16; forward_step: the entry point's
        (data_iterator, model) -> (output, loss_func), run on every micro-batch (None: the
        model's per-token loss under the loss mask)."""
        self.options = options
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(options.device) if options.device is not None else default_device()
        mcore_compat.ensure_global_memory_buffer()
        if self.device.type == "cuda":  # megatron-core's GPU initialisation forks its RNG tracker
            seed_rng_tracker(options.init_seed, 0, 0)  # (on meta parameters: the pull gives the values)
        self.bank = StageBank(replica_types, make_config, build_model, device=self.device,
                              sequence_parallel=options.sequence_parallel, layer_strategies=options.layer_strategies,
                              forward_step=forward_step)
        self.server = ParameterServer(
            self.bank.space, options.optimizer, device=self.device, param_dtype=self.bank.param_dtype,
            num_layers=self.bank.num_layers, norm_init=self.bank.norm_init, init_seed=options.init_seed,
            init_std=options.init_std, bucket_numel=options.bucket_numel, exchange=options.exchange,
            overlap=options.overlap, reduce_dtype=torch.bfloat16 if options.grad_reduce_in_bf16 else torch.float32,
            grad_scaler=grad_scaler)
        self.bank.build(self.server.sharding)
        self.phase = untimed  # name -> context manager timing one phase of a step (`time_phases`)

    # the parts other rooms read (checkpoints, logs, tests)
    space = property(lambda self: self.bank.space)
    registry = property(lambda self: self.bank.registry)
    host_group = property(lambda self: self.bank.registry.host_group)  # gloo over every rank on GPU runs
    sharding = property(lambda self: self.server.sharding)
    optimizer = property(lambda self: self.server.optimizer)

    def time_phases(self, timer: Callable) -> None:
        """Time a step's phases with `timer(name)` (--timing-log-level 2; names in timing.PHASES)."""
        self.phase = timer

    def persistent_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the whole run, by kind (what the cost model charges)."""
        return {**self.bank.persistent_bytes(), **self.server.persistent_bytes()}

    def set_canonical(self, flat: torch.Tensor, reset_optimizer: bool = False) -> None:
        self.server.set_canonical(flat, reset_optimizer)

    def gather_tensor(self, shard: torch.Tensor, tensor, dst: int) -> torch.Tensor | None:
        return self.server.gather_tensor(shard, tensor, dst)

    def gather_canonical(self) -> torch.Tensor:
        return self.server.gather_canonical()

    def local_plan(self, it: IterationPlan) -> LocalPlan:
        return LocalPlan.resolve(it, self.bank)

    # --------------------------------------------------------------------- steps
    def train_iteration(self, it: IterationPlan, dataset, *, eod_mask_loss: bool = False,
                        eod: int | None = None, update: bool = True) -> StepResult:
        """One training step of the plan on a document dataset: this rank's micro-batches are
        fetched, packed, padded and localised here, the loss divisor is the global batch's
        loss-token count. Raises NoTrainableTokens if the global batch has none. `update`
        False: all but the optimizer's update (parameters, optimizer state and loss scale
        stay; the next push zeroes the gradients): what the startup calibration times."""
        with self.phase("dcp-fetch-pack"):
            loss_tokens = num_loss_tokens(dataset, it.sample_ids, eod_mask_loss, eod)
            if loss_tokens == 0:
                raise NoTrainableTokens(f"iteration {it.index}: no token of the global batch is trained on")
            local = self.local_plan(it)
            micro_batches = local.localize(local.fetch(dataset, eod_mask_loss, eod), self.device)
        return self._step(local, micro_batches, loss_tokens, update)

    def step(self, it: IterationPlan, batches: list, loss_tokens: int) -> StepResult:
        """One training step on micro-batches packed by the caller (ThdBatch, plan order,
        padded per `local_plan(it)`); `loss_tokens`: the global batch's loss-token count."""
        local = self.local_plan(it)
        return self._step(local, local.localize(batches, self.device), loss_tokens)

    def eval_iteration(self, it: IterationPlan, dataset, *, eod_mask_loss: bool = False,
                       eod: int | None = None) -> tuple[float, float]:
        """Forward only under the plan's layout on a document dataset: (loss sum, loss tokens)."""
        local = self.local_plan(it)
        return self._evaluate(local, local.fetch(dataset, eod_mask_loss, eod))

    def evaluate(self, it: IterationPlan, batches: list) -> tuple[float, float]:
        """Forward only on micro-batches packed by the caller: (loss sum, loss tokens)."""
        return self._evaluate(self.local_plan(it), batches)

    def _evaluate(self, local: LocalPlan, batches: list) -> tuple[float, float]:
        micro_batches = local.localize(batches, self.device)
        seed_rng_tracker(self.options.init_seed, local.it.index, local.coords[0])
        pull = self._begin_pull(local)[0]
        with self.bank.streaming(pull):
            loss_sum, tokens = local.stage.runner.evaluate(micro_batches, pull)
            pull.drain()
        return tuple(self._reduce(local, loss_sum, tokens, 0.0, 0.0)[:2])

    def _begin_pull(self, local: LocalPlan, clock=None):
        """Bind the iteration's alternative layers and start the pull: (pull stream, exchange
        plan, buffer elements in use, push buckets per bound parameter)."""
        numel, push_buckets = self.bank.bind_for(local.stage, local.my_needs)
        plan = self.server.layout_plan(local.layout_key(), lambda: self.bank.layout(local.it, local.needs))
        return self.server.pull(plan, self.bank.params, clock), plan, numel, push_buckets

    def _step(self, local: LocalPlan, micro_batches: list, loss_tokens: int, update: bool = True) -> StepResult:
        overlap, runner = self.options.overlap, local.stage.runner
        seed_rng_tracker(self.options.init_seed, local.it.index, local.coords[0])
        moved_before = self.server.bytes_moved()
        clock = DeviceClock(self.device)  # the step's device times, read once at its end
        t0 = time.perf_counter()
        with self.phase("dcp-pull"), clock.span(EXCHANGE) if not overlap else nullcontext():
            pull, plan, numel, push_buckets = self._begin_pull(local, clock)
        self.bank.main_grads[:numel].zero_()
        scale = self.server.loss_scale()
        push = self.server.push(plan, self.bank.main_grads, push_buckets, clock)
        with self.bank.streaming(pull, push):
            with self.phase("forward-backward"):
                loss_sum, tokens = runner.run(micro_batches, scale / max(loss_tokens, 1), pull, push, clock)
                pull.drain()
            with self.phase("dcp-push"), clock.span(EXCHANGE) if not overlap else nullcontext():
                push.finish()
        self.server.unscale(scale)
        seconds = clock.seconds()  # the step's one wait for its timings
        waited = seconds.get(EXCHANGE, 0.0) + seconds.get(WAIT, 0.0)
        timings = LocalTimings(local.index, runner.pp_rank, DeviceClock.per_index(seconds, len(micro_batches)),
                               seconds.get(EXCHANGE, 0.0), time.perf_counter() - t0)
        with self.phase("dcp-reduce"):  # the loss and the gradient norm: the step's one read of device values
            loss, tokens, moved, worst_wait, least_wait, square = self._reduce(
                local, loss_sum, tokens, self.server.bytes_moved() - moved_before, waited,
                self.server.optimizer.grad_square_sum())
        norm = math.sqrt(square)
        with self.phase("optimizer"):
            ok = self.server.step(norm) if update else False
        return StepResult(loss, tokens, norm, ok, moved, worst_wait, scale, timings, exchange_s=least_wait)

    def _reduce(self, local: LocalPlan, loss_sum, tokens, moved: float, waited: float,
                square=None) -> list[float]:
        """Every token's loss once (last stages, TP rank 0: TP ranks hold identical losses),
        bytes moved summed, the longest and the shortest wait, the squared gradient norm
        summed over the shards: one all-gather, summed in rank order, read on the host once."""
        counts = local.stage.runner.last and local.coords[0] == 0
        zero = torch.zeros(1, dtype=torch.float64, device=self.device)
        mine = torch.cat([_on(loss_sum, self.device) if counts else zero, _on(tokens, self.device) if counts else zero,
                          values_on_device([moved, waited], self.device),
                          _on(square, self.device) if square is not None else zero])
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        every = torch.stack(every).cpu()
        return every[:, :3].sum(0).tolist() + [float(every[:, 3].max()), float(every[:, 3].min()),
                                               float(every[:, 4].sum())]


def _on(value, device) -> torch.Tensor:
    """A device scalar, or a host number put on the device without a wait, as a 1-element float64 tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(1)
    return values_on_device([value], device)

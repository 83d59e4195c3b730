"""The `--dcp` training loop: per-iteration plans on the adaptive engine.

Glue only: documents from the variable-length data path, global batches by tokens
(docs/contracts.md), a plan per iteration from `dcp_ext.planning.planner` (the next one computed in a
background thread while this one trains), `dcp_ext.runtime.AdaptiveEngine` for the step,
Megatron's LR schedule, log line and checkpoint layout. It reads no flags: `pretrain()`
hands `AdaptiveRun` its seed, cluster and the door's `configure()`, and the iterations take
the `StepOptions` record it builds.
"""
from __future__ import annotations

import copy
import json
import math
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from megatron.training.adaptive import startup_calibration
from megatron.training.checkpoint import checkpointing_adaptive, finite_weights
from megatron.training.checkpoint.config import CheckpointConfig
from megatron.training.errors import TrainingError
from megatron.training.initialize import print_rank_0, set_random_seed_without_parallel_state
from megatron.training.loop.batch_schedule import GlobalBatchSizes
from megatron.training.loop.run import Outcome
from megatron.training.adaptive.online_calibration import OnlineCalibration
from dcp_ext.planning.planners.explain import layout_label, layout_summary


@dataclass(frozen=True)
class StepOptions:
    """What the `--dcp` iterations need of the flags, read once (`run_config.AdaptiveRunConfig`)."""

    global_batch_tokens: int  # --dcp-global-batch-tokens
    max_seq_len: int  # --dcp-max-seq-len: longer documents are cut
    seq_length: int  # --seq-length: a batch-size schedule's samples are this many tokens
    batch_sizes: GlobalBatchSizes  # each iteration's global batch size (a schedule's)
    train_iters: int
    lr_step_increment: int  # the scheduler's step: 1, or --global-batch-size under --train-samples
    eval_iters: int = 0
    eval_interval: int | None = None
    split: str = ""  # --split, for the line that says a split holds no document
    eod_mask_loss: bool = False
    eod: int | None = None  # the tokenizer's end-of-document id
    fp16: bool = False  # a skipped step may be the loss scaler's back-off
    log_interval: int = 100
    log_plan: str | None = None  # --dcp-log-plan: each iteration's plan, one JSON line


@dataclass(frozen=True)
class LossScaling:
    """--fp16's loss scaler (megatron-core's: dynamic unless --loss-scale)."""

    loss_scale: float | None
    initial: float
    minimum: float
    window: int
    hysteresis: int


def grad_scaler(scaling: LossScaling | None):
    """The engine's loss scaler (on the device: built once the run is set up), or none."""
    if scaling is None:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if scaling.loss_scale is not None:
        return ConstantGradScaler(scaling.loss_scale)
    return DynamicGradScaler(initial_scale=scaling.initial, min_scale=scaling.minimum, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=int(scaling.window), hysteresis=scaling.hysteresis)


def say_what_the_data_leaves_out(options: StepOptions, train_ds, valid_ds) -> None:
    """Once, at start: the tokens --dcp-max-seq-len cuts, and an evaluation asked for that
    cannot run because the validation split holds no document."""
    from dcp_ext.data.documents import truncation_note

    o = options
    note = truncation_note(train_ds, o.max_seq_len) if train_ds is not None else None
    if note:
        print_rank_0(f"WARNING: {note}")
    if valid_ds is None and o.eval_iters > 0 and o.eval_interval and o.eval_interval <= o.train_iters:
        print_rank_0(f"WARNING: no evaluation: --split {o.split} leaves the validation split without a document, "
                     f"so --eval-iters {o.eval_iters} --eval-interval {o.eval_interval} never run; give the "
                     "validation split a share (e.g. --split 98,2,0) or set --eval-iters 0")


def static_layout_line(config, planner) -> str:
    """The one line said at start: where the line's static layout is in the planner
    (`config`: the run's PlannerConfig)."""
    tp, cp, pp = config.static_layout
    what = f"static layout tp={tp} pp={pp} cp={cp}"
    in_pool = planner.static_entry_in_pool()
    if in_pool is not None:
        held, n = in_pool
        where = "is in" if held else "is not in"
        why = "" if where == "is in" else (" (hydraulis has no context parallelism)" if cp > 1 and
                                           config.name == "hydraulis" else " (it does not fit beside the pool)")
        return f"dcp: {what} {where} the candidate pool{why} ({n} candidate{'s' if n != 1 else ''}, --dcp-candidates {config.candidates})"
    if config.name == "static":
        return f"dcp: {what} is the static planner's layout ({planner.describe()})"
    return (f"dcp: {what} is not used by planner {config.name}, which picks its own tp/pp and sizes CP per "
            f"sequence ({planner.describe()})")


def build_planner(config, lengths, cluster, model):
    """The planner of `config` (the run's PlannerConfig) for `model` on `cluster`, its pool
    chosen for documents like `lengths` (the training split's, the first 200,000)."""
    from dcp_ext.planning.planner import make_planner
    from dcp_ext.planning.planners.errors import PlanningError

    sample = lengths[:200_000]
    started = time.perf_counter()
    try:
        planner = make_planner(config.name, model, cluster, max_seq_len=config.max_seq_len,
                               global_batch_tokens=config.global_batch_tokens, length_sample=[int(x) for x in sample],
                               profile=config.cost_profile, memory_margin=config.memory_margin, seed=config.seed,
                               **config.options())
    except PlanningError as e:
        if config.name != "static" or "cannot hold" not in str(e):
            raise
        tp, cp, pp = config.static_layout
        raise PlanningError(f"--dcp-planner static runs the line's layout tp={tp} pp={pp} cp={cp}, which cannot hold "
                            f"a pack of --dcp-max-seq-len {config.max_seq_len} tokens on {cluster.name}: "
                            "raise --tensor-model-parallel-size / --pipeline-model-parallel-size / "
                            "--context-parallel-size or lower --dcp-max-seq-len") from None
    print_rank_0(f"> dcp: {config.name} planner built in {time.perf_counter() - started:.1f} s")
    print_rank_0(static_layout_line(config, planner))
    return planner


class SplitBatches:
    """The global batches of a validation or test split, one after another across calls
    (as upstream's one data iterator per split), from the split's start again at its end."""

    def __init__(self, options: StepOptions, dataset, skip: int = 0):
        self.options, self.dataset = options, dataset
        self.stream = self._from_start()
        try:
            for _ in range(skip):  # a resumed run: the batches its earlier evaluations took
                self.next()
        except StopIteration:  # no batch in the split: evaluate() says nothing is there
            pass

    def _from_start(self):
        from dcp_ext.data.batches import GlobalBatchStream

        return GlobalBatchStream(self.dataset, self.options.global_batch_tokens, self.options.max_seq_len,
                                 limit=len(self.dataset))

    def next(self):
        try:
            return self.stream.next()
        except StopIteration:
            self.stream = self._from_start()
            return self.stream.next()  # StopIteration again: the split holds no batch


def evaluate(options: StepOptions, engine, planner, dataset, batches: SplitBatches | None = None) -> float:
    """Per-token loss over the next --eval-iters global batches of `batches` (a walk through
    `dataset`; without one, its first batches)."""
    batches = batches if batches is not None else SplitBatches(options, dataset)
    total, tokens = 0.0, 0.0
    for i in range(options.eval_iters):
        try:
            batch = batches.next()
        except StopIteration:
            break
        it = planner.plan(i, batch.sample_ids, batch.lengths)
        loss_sum, n = engine.eval_iteration(it, dataset, eod_mask_loss=options.eod_mask_loss, eod=options.eod)
        total, tokens = total + loss_sum, tokens + n
    return total / max(tokens, 1.0)


def no_loss_tokens_message(options: StepOptions, iteration: int, dataset, batch) -> str:
    """A global batch with no token to train on would train at loss 0: say why, naming a sample."""
    prefix, doc, _ = dataset.source(batch.sample_ids[0])
    if getattr(dataset, "has_loss_mask", False):
        why = (f"their SFT loss mask is 0 on every token kept (prompts longer than --dcp-max-seq-len "
               f"{options.max_seq_len}?)")
    else:
        why = "every sample is one token long" + (" or all EOD (--eod-mask-loss)" if options.eod_mask_loss else "")
    return (f"iteration {iteration}: the global batch's {len(batch.sample_ids)} samples have no token to train on: "
            f"{why}; first sample: {prefix} document {doc}")


class AdaptiveRun:
    """The adaptive runtime's parts, in `training.train_run`'s order: the cluster, the
    documents, the padded vocabulary and the planner (before the memory report, as the
    static path's data), then the engine."""

    def __init__(self, seed: int, cluster, datasets: Callable[[], tuple], configure: Callable[[], Any],
                 model_provider, forward_step_func=None):
        """`cluster`: the ClusterSpec this job runs on (`run_config.cluster_for`); `datasets()`:
        the (train, valid, test) document datasets (the entry script's provider);
        `configure()`: the run's AdaptiveRunConfig, called once the data is read
        (`run_config.configure`);
        forward_step_func: the entry point's, run on every micro-batch as on the static path."""
        self.seed_value, self.cluster, self.datasets, self.configure = seed, cluster, datasets, configure
        self.model_provider, self.forward_step_func = model_provider, forward_step_func
        self.recalibration = None

    def seed(self) -> None:
        set_random_seed_without_parallel_state(self.seed_value)
        # megatron-core's RNG tracker seeded before anything is built, as the static path
        # does (the engine re-seeds it for every step's TP rank)
        from dcp_ext.runtime.params.initial_values import seed_rng_tracker

        seed_rng_tracker(self.seed_value, 0, 0)

    def data(self) -> None:
        self.train_ds, self.valid_ds, self.test_ds = self.datasets()
        self.config = self.configure()
        say_what_the_data_leaves_out(self.config.steps, self.train_ds, self.valid_ds)
        if self.config.overlap_note:
            print_rank_0(self.config.overlap_note)
        self.planner = build_planner(self.config.planner, self.train_ds.lengths, self.cluster, self.config.model)

    def build(self, peak_memory):
        from dcp_ext.runtime.engine import AdaptiveEngine

        config, types = self.config, self.planner.replica_types()
        self.engine = engine = AdaptiveEngine(
            types, config.layer_config,
            lambda layer_config, pre, post, pg: self.model_provider(layer_config, pre_process=pre, post_process=post,
                                                                    pg_collection=pg),
            config.engine, grad_scaler=grad_scaler(config.loss_scaling), forward_step=self.forward_step_func)
        held = engine.persistent_bytes()
        print_rank_0(f"> adaptive runtime: planner {config.planner.name}, {len(types)} replica types, "
                     f"{engine.registry.num_groups} process groups, {engine.space.numel:,} parameters "
                     f"sharded over {self.cluster.num_gpus} ranks in {engine.sharding.num_buckets} buckets; rank 0 "
                     "holds " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in held.items()))
        if config.planner.rechoose_pool:  # --dcp-recalibration on
            self.recalibration = OnlineCalibration(self.planner, engine.device, peak_memory, engine.host_group)
            at_rest = self.recalibration.charge_at_rest(engine)
            print_rank_0(f"> memory beyond the model at rest (the most over ranks, charged from the first plan): "
                         f"{at_rest / 2**20:.0f} MiB")
        return engine.optimizer

    def load(self, scheduler) -> tuple[int, int]:
        return checkpointing_adaptive.load(self.config.checkpoint, self.engine, scheduler, self.planner)

    def steps(self, scheduler, consumed_samples: int, logger, features) -> "AdaptiveSteps":
        self.engine.time_phases(lambda name: features.timer(name, level=2))  # --timing-log-level 2: the step's phases
        if startup_calibration.wanted(self.config.planner, self.planner, consumed_samples):
            from dcp_ext.data.batches import GlobalBatchStream

            o = self.config.steps
            first = GlobalBatchStream(self.train_ds, o.global_batch_tokens, o.max_seq_len).peek(1)
            line = first and startup_calibration.calibrate_at_start(self.engine, self.planner, self.recalibration,
                                                                     self.train_ds, first[0],
                                                                     eod_mask_loss=o.eod_mask_loss, eod=o.eod)
            if line:
                print_rank_0(line)
        self.adaptive_steps = AdaptiveSteps(self.config.steps, self.engine, self.planner, scheduler, self.train_ds,
                                            self.valid_ds, consumed_samples, logger, features, self.recalibration,
                                            test_ds=self.test_ds, checkpointing=self.config.checkpoint)
        return self.adaptive_steps

    def finish(self) -> None:
        if self.recalibration is not None:
            print_rank_0(f"> cost model recalibrated online: {self.recalibration.summary()}")
        steps = getattr(self, "adaptive_steps", None)
        line = steps.headroom_line() if steps is not None else None
        if line:
            print_rank_0(line)


HEADROOM_WINDOW = 20  # the last iterations the closing headroom line sums (`AdaptiveSteps.headroom_line`)


class AdaptiveSteps:
    """One iteration of the adaptive runtime: the planner's plan for the next global batch
    (the one after it planned in a background thread meanwhile), run by the engine."""

    save_without_progress = False

    def __init__(self, options: StepOptions, engine, planner, scheduler, train_ds, valid_ds, consumed, logger,
                 features, recalibration: OnlineCalibration | None = None, test_ds=None,
                 checkpointing: CheckpointConfig | None = None):
        from dcp_ext.data.batches import GlobalBatchStream

        self.options, self.engine, self.planner, self.scheduler = options, engine, planner, scheduler
        self.checkpointing = checkpointing  # what save() writes where
        self.train_ds, self.valid_ds, self.logger, self.features = train_ds, valid_ds, logger, features
        self.has_validation = valid_ds is not None
        self.test_ds, self.has_test = test_ds, test_ds is not None
        self.valid_batches = None  # the validation pass, walking on across evaluations (start_validation_at)
        self.eval_planner = copy.deepcopy(planner)  # evaluation must not disturb the training plan sequence
        self.first_iteration = None  # the first run()'s: a --step-batch-size-schedule's budgets count from it
        self.stream = GlobalBatchStream(train_ds, self._budget(), options.max_seq_len, consumed_samples=consumed)
        self.planning = ThreadPoolExecutor(max_workers=1)
        self.upcoming = None
        self.recalibration = recalibration
        self.planner_state = planner.planning_state()  # as of the last plan run, before the next is made
        self.window_layouts = Counter()
        self.previous = None  # the last iteration's plan and lengths, for the layout-change line
        self.batch = self.it = self.result = None
        self.plan_s = 0.0
        self.recent = deque(maxlen=HEADROOM_WINDOW)  # (lengths, measured s, predicted s) of the last iterations

    def _plan(self, index, batch):
        t0 = time.perf_counter()
        it = self.planner.plan(index, batch.sample_ids, batch.lengths)
        return it, time.perf_counter() - t0

    def _budget(self):
        """Tokens per global batch: --dcp-global-batch-tokens, or with --step-batch-size-schedule
        the size of the batch's iteration times --seq-length (a function of the batch's index)."""
        o = self.options
        if o.batch_sizes.schedule is None:
            return o.global_batch_tokens
        return lambda j: o.batch_sizes.of_iteration(self.first_iteration + j) * o.seq_length

    def run(self, iteration: int) -> Outcome:
        from dcp_ext.runtime.step_result import ForwardStepError, NoTrainableTokens

        o = self.options
        if self.first_iteration is None:
            self.first_iteration = iteration
        start = time.perf_counter()
        self.batch = batch = self.stream.next()
        with self.features.timer("dcp-plan-wait", level=2):
            self.it, self.plan_s = self.upcoming.result() if self.upcoming is not None else self._plan(iteration, batch)
        if list(self.it.sample_ids) != list(batch.sample_ids):
            raise RuntimeError(f"iteration {iteration}: prefetched plan does not match the batch")
        line = self.planner.pool_line(iteration)
        if line:
            print_rank_0(line)
        if self.recalibration is not None:
            self.recalibration.between_plans()  # the planner is idle: the next plan sees the new prices
        self.planner_state = self.planner.planning_state()
        ahead = self.stream.peek(1)
        more = ahead and iteration + 1 < o.train_iters
        self.upcoming = self.planning.submit(self._plan, iteration + 1, ahead[0]) if more else None
        try:
            with self.features.timer("adaptive-step"):
                self.result = result = self.engine.train_iteration(self.it, self.train_ds,
                                                                   eod_mask_loss=o.eod_mask_loss, eod=o.eod)
        except NoTrainableTokens:
            raise TrainingError(no_loss_tokens_message(o, iteration + 1, self.train_ds, batch)) from None
        except ForwardStepError as e:
            raise TrainingError(str(e)) from None
        ok = result.update_successful and math.isfinite(result.loss)
        if ok:
            # 1, or --global-batch-size under --train-samples; a batch-size schedule's samples of this iteration
            self.scheduler.step(increment=o.lr_step_increment if o.batch_sizes.schedule is None
                                else o.batch_sizes.of_iteration(iteration))
        finite_weights.inject_nan_weights([self.engine.optimizer.master()], iteration + 1)  # a test hook
        if self.recalibration is not None:
            self.recalibration.measured(self.it, batch, result, time.perf_counter() - start)
            # queued, applied at the next iteration's start: a checkpoint now keeps it
            self.planner_state = {**self.planner_state, "calibration": self.recalibration.state_dict()}
        overflow = o.fp16 and not result.update_successful and math.isfinite(result.loss)  # loss scaler's skip
        return Outcome(result.loss, ok, bool(overflow))

    def log(self, iteration: int, outcome: Outcome, elapsed_s: float) -> None:
        from dcp_ext.planning.flops import training_flops
        from dcp_ext.planning.plan import iteration_to_json

        o, it, batch, result = self.options, self.it, self.batch, self.result
        flops = training_flops(batch.lengths, **self.logger.model_shape())
        summary = layout_summary(it)
        self.window_layouts[layout_label(it)] += 1
        lengths_of = dict(zip((int(i) for i in batch.sample_ids), (int(n) for n in batch.lengths)))
        for line in self.planner.explain(iteration, self.previous, it, lengths_of):
            print_rank_0(line)
        self.previous = (it, max(lengths_of.values(), default=0))
        self.recent.append(([int(n) for n in batch.lengths], elapsed_s, it.predicted_time_s))
        extra = (f" {summary} | predicted/measured (ms): {1000 * it.predicted_time_s:.1f}/"
                 f"{1000 * elapsed_s:.1f} | plan (ms): {1000 * self.plan_s:.1f} | exposed comm (ms): "
                 f"{1000 * result.exposed_comm_s:.1f} | exchange (ms): {1000 * result.exchange_s:.1f} | "
                 f"tokens: {sum(batch.lengths)} |")
        if iteration % o.log_interval == 0:
            if o.log_interval > 1:
                extra += " layouts since last log: " + ", ".join(f"{k} x{v}" for k, v in self.window_layouts.items()) + " |"
            self.window_layouts.clear()
        self.logger.log_iteration(iteration, self.stream.consumed_samples, elapsed_s, {"lm loss": result.loss},
                                  self.scheduler, self.engine.optimizer, result.grad_norm, outcome.applied, flops,
                                  len(batch.sample_ids), extra=extra,
                                  record={"tokens": sum(batch.lengths), "elapsed_s": elapsed_s,
                                          "bytes_moved": result.bytes_moved, "exposed_comm_s": result.exposed_comm_s,
                                          "exchange_s": result.exchange_s,
                                          "layout": summary,
                                          **(self.recalibration.balance_record(it) if self.recalibration else {})})
        if o.log_plan and dist.get_rank() == 0:
            with open(o.log_plan, "a") as f:
                f.write(json.dumps(iteration_to_json(it)) + "\n")

    def headroom_line(self) -> str | None:
        """What the last iterations took, what their plans predicted, and the lower bound of
        their batches with the prices as calibrated now (`dcp_ext.planning.bound`: no plan of
        those batches beats it by the cost model): how much a better plan could still win."""
        if not self.recent:
            return None
        try:
            bound = self.planner.lower_bound_s([lengths for lengths, _, _ in self.recent])
        except ValueError:  # a batch no layout of the bound holds (a fixed planner's own layouts)
            return None
        measured = sum(m for _, m, _ in self.recent)
        predicted = sum(p for _, _, p in self.recent)
        return (f"> planner over the last {len(self.recent)} iterations: measured {measured:.2f} s, planned "
                f"{predicted:.2f} s, lower bound {bound:.2f} s with the calibrated prices (no plan of these batches "
                f"is faster by the cost model): measured/bound {measured / bound:.2f}x")

    def start_validation_at(self, batches: int) -> None:
        self.valid_batches = SplitBatches(self.options, self.valid_ds, skip=batches)

    def evaluate(self, iteration: int, prefix: str, split: str = "valid") -> None:
        """The next --eval-iters global batches of the validation split, or (split 'test')
        the test split's first ones."""
        if split == "test":
            loss = evaluate(self.options, self.engine, self.eval_planner, self.test_ds)
        else:
            if self.valid_batches is None:
                self.valid_batches = SplitBatches(self.options, self.valid_ds)
            loss = evaluate(self.options, self.engine, self.eval_planner, self.valid_ds, self.valid_batches)
        self.logger.log_validation(iteration, loss, prefix, scalars=split != "test")

    def save(self, iteration: int) -> None:
        checkpointing_adaptive.save(self.checkpointing, iteration, self.stream.consumed_samples, self.engine,
                                    self.scheduler, self.planner_state)

    def close(self) -> None:
        self.planning.shutdown(wait=True)

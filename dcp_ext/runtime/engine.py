"""The adaptive engine: one training step under whatever layout the plan names.

Built once per run from the planner's finite set of replica types:
- process groups of every replica type (GroupRegistry);
- on each rank, the megatron-core GPTModel stage it plays in every replica type it
  belongs to, built with that replica's groups passed explicitly (no global
  parallel_state). A rank runs one stage per iteration and the pull fills it, so all its
  stages share storage: one parameter buffer (compute dtype) and one fp32 main-grad
  buffer, sized to the largest stage; every stage's parameters and `.main_grad`s are
  views into them, and a new replica type costs no parameter memory;
- the stage's map into the canonical space (strided runs, O(tensors));
- the fixed optimizer sharding (ShardedOptimizer: AdamW or SGD) and the bucketed pull/push exchange.
A step: pull the parameters of this iteration's stage (bucket by bucket, the next bucket
in flight while a layer computes when overlapping), run the replica's micro-batches
(1F1B, THD, CP), accumulate gradients in fp32 main grads, push each bucket's gradients
to their owner shards as soon as the last backward has produced them, clip on the global
norm, AdamW (fp16: unscale, skip on overflow, Megatron's dynamic loss scaler).
Every tensor lives on the model's device (`device`): NCCL on GPUs, gloo on CPUs.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dcp_ext.compat import mcore_compat
from dcp_ext.data.thd import materialize, num_loss_tokens
from dcp_ext.planning.plan import IterationPlan
from dcp_ext.runtime.exchange import ParamExchange
from dcp_ext.runtime.executor import StageRunner, localize
from dcp_ext.planning.layout import ReplicaType
from dcp_ext.runtime.groups import GroupRegistry
from dcp_ext.runtime.param_map import CanonicalSpace, LocalParam, map_stage
from dcp_ext.runtime.sharded_optimizer import OptimizerOptions, ShardedOptimizer
from dcp_ext.runtime.sharding import FixedSharding
from dcp_ext.runtime.streams import PullStream, PushStream
from dcp_ext.runtime.layer_switch import SwitchContext
from dcp_ext.runtime.strategy_library import (alternative_types, apply_stage_layers, bind_alternatives,
                                              build_alternative, gather_alternative_runs, stage_strategies,
                                              switch_needs, switched_layout)
from dcp_ext.runtime.timing import LocalTimings, PhaseClock, untimed
from dcp_ext.runtime.initial_values import INIT_CHUNK, init_values, seed_rng_tracker

@dataclass
class Stage:
    rep: ReplicaType
    runner: StageRunner
    local: list[LocalParam]
    sequence_parallel: bool
    numel: int
    runs: list = field(default_factory=list)  # (runs in buffer coordinates, pushes_grad) per parameter
    push_buckets: list = field(default_factory=list)  # per parameter: buckets its gradient pushes into


@dataclass
class StepResult:
    loss_sum: float  # summed over the global batch (every token once)
    loss_tokens: float
    grad_norm: float
    update_successful: bool
    bytes_moved: float = 0.0  # pull + push, all ranks together, this step
    exposed_comm_s: float = 0.0  # time this rank spent blocked on pull/push (max over ranks)
    loss_scale: float = 1.0
    timings: LocalTimings | None = None  # this rank's (timing.reduce_step makes them global)
    exchange_s: float = 0.0  # the quickest rank's time blocked on pull/push: the exchange itself (the
    # last rank to arrive waits for nobody); exposed_comm_s minus this is waiting for the slowest rank

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.loss_tokens, 1.0)


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class NoTrainableTokens(ValueError):
    """The global batch has no token whose loss counts (all masked, or one-token samples)."""


# Canonical tensors megatron-core's LanguageModule marks `is_embedding_or_output_parameter`
# (a tied output layer is the word embedding itself).
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


class AdaptiveEngine:
    def __init__(
        self,
        replica_types: Sequence[ReplicaType],
        make_config: Callable[[int, int, int, bool], object],
        build_model: Callable[[object, bool, bool, object], torch.nn.Module],
        *,
        sequence_parallel: bool,
        lr: float,
        weight_decay: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        exchange: str = "targeted",
        init_seed: int = 1234,
        init_std: float = 0.02,
        device=None,
        overlap: bool = False,
        grad_reduce_in_bf16: bool = False,
        bucket_numel: int | None = None,
        grad_scaler=None,
        optimizer_options: OptimizerOptions | None = None,
        layer_strategies: bool = False,
    ):
        """optimizer_options: every optimizer flag (--optimizer, betas, momentum, decoupled LR);
        without it, AdamW from lr/weight_decay/betas/eps/clip_grad.
        make_config(tp, cp, pp, sequence_parallel) -> TransformerConfig;
        build_model(config, pre_process, post_process, pg_collection) -> GPTModel stage.
        device 'meta' builds every tensor without memory (scale checks).
        layer_strategies: every stage can run its layers under any re-factoring of its
        tp*cp ranks (plan contract v2); builds a decoder-only stage per alternative."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device(device) if device is not None else default_device()
        self.init_seed = init_seed
        self.overlap = overlap
        self.grad_scaler = grad_scaler
        mcore_compat.ensure_global_memory_buffer()
        self.make_config = make_config
        full_config = make_config(1, 1, 1, False)
        planned = sorted(set(replica_types), key=ReplicaType.sort_key)
        heads = full_config.num_attention_heads
        refactorings = {rep: alternative_types(rep, heads, full_config.num_query_groups or heads)
                        for rep in planned} if layer_strategies else {}
        self.registry = GroupRegistry(planned + [a for alts in refactorings.values() for a in alts])
        # The canonical space: the full model, built on the meta device (no memory).
        self.num_layers = full_config.num_layers
        self.gated = bool(full_config.gated_linear_unit)
        self.param_dtype = full_config.params_dtype or torch.float32
        self.norm_init = 0.0 if getattr(full_config, "layernorm_zero_centered_gamma", False) else 1.0
        single = self.single_rank_collection()
        with torch.device("meta"):
            full = build_model(full_config, True, True, single)
        self.space = CanonicalSpace(full)
        del full
        self.sharding = FixedSharding(self.space.numel, self.world, bucket_numel)
        # This rank's stage in every replica type it belongs to, sharing two buffers. The
        # largest stages (smallest tp*pp) come first, so the buffers rarely grow.
        self.params = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self.main_grads = torch.empty(0, dtype=torch.float32, device=self.device)
        self.stages: dict[ReplicaType, Stage] = {}
        mine = [rep for rep in planned if self.rank in rep.ranks]
        for rep in sorted(mine, key=lambda r: r.tp * r.pp):
            self.stages[rep] = self._build_stage(rep, sequence_parallel and rep.tp > 1, make_config, build_model)
        self._all_runs = self._gather_stage_runs()
        self.sequence_parallel = sequence_parallel
        self.alternatives: dict[ReplicaType, dict] = {}
        if layer_strategies:
            for rep in mine:
                self.alternatives[rep] = {(a.tp, a.cp): build_alternative(self, a, build_model) for a in refactorings[rep]}
                self.stages[rep].runner.switching = SwitchContext.for_stage(
                    self.stages[rep], self.alternatives[rep], self.registry, self.rank, sequence_parallel)
        self._alt_runs = gather_alternative_runs(self.alternatives, self.world) if layer_strategies else {}
        # The fixed sharding.
        if optimizer_options is None:
            optimizer_options = OptimizerOptions(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                                                 clip_grad=clip_grad)
        self.optimizer = ShardedOptimizer(self.initial_shard(init_seed, init_std), self._decay_runs(),
                                          optimizer_options)
        self.optimizer.grad_scaler = grad_scaler
        reduce_dtype = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
        self.exchange = ParamExchange(self.sharding, device=self.device, param_dtype=self.param_dtype,
                                      reduce_dtype=reduce_dtype, mode=exchange, slots=2 if overlap else 1)
        self._pull: PullStream | None = None
        self._push: PushStream | None = None
        self.phase = untimed  # name -> context manager timing one phase of a step (`time_phases`)

    def time_phases(self, timer: Callable[[str], contextlib.AbstractContextManager]) -> None:
        """Time a step's phases with `timer(name)` (--timing-log-level 2; names in timing.PHASES)."""
        self.phase = timer

    # ------------------------------------------------------------------- building
    def _config(self, rep: ReplicaType, sp: bool):
        config = self.make_config(rep.tp, rep.cp, rep.pp, sp)
        apply_stage_layers(config, rep.stage_layers)
        return config

    def _build_stage(self, rep: ReplicaType, sp: bool, make_config, build_model) -> Stage:
        config = self._config(rep, sp)
        tp_rank, _, pp_rank = rep.coords(self.rank)
        where = torch.device("meta") if self.device.type == "meta" else contextlib.nullcontext()
        with where:
            model = build_model(config, pp_rank == 0, pp_rank == rep.pp - 1, self.registry.collection(rep))
        local = map_stage(model, self.space, rep.tp, tp_rank, self.gated)
        numel = sum(lp.numel for lp in local)
        if numel > self.params.numel():
            self._grow_buffers(numel)
        stage = Stage(rep, StageRunner(model, config, rep, self.rank, self.num_layers), local, sp, numel)
        self._bind(stage)
        for lp in local:
            stage.runs.append((tuple(r.shifted(lp.offset) for r in lp.runs), lp.pushes_grad))
            stage.push_buckets.append(sorted({b for r in lp.runs for b in self.sharding.buckets_of(r.canon, r.canon_end)})
                                      if lp.pushes_grad else [])
            lp.param.register_post_accumulate_grad_hook(self._grad_hook(lp, stage.push_buckets[-1]))
        for module, buckets in self._module_buckets(model, local):
            module.register_forward_pre_hook(self._pull_hook(max(buckets)))
        return stage

    def _grow_buffers(self, numel: int) -> None:
        self.params = torch.empty(numel, dtype=self.param_dtype, device=self.device)
        self.main_grads = torch.zeros(numel, dtype=torch.float32, device=self.device)
        for stage in self.stages.values():  # rebind the smaller stages built before
            self._bind(stage)

    def _bind(self, stage: Stage) -> None:
        for lp in stage.local:
            shape = lp.param.shape
            lp.param.data = self.params[lp.offset : lp.offset + lp.numel].view(shape)
            lp.param.main_grad = self.main_grads[lp.offset : lp.offset + lp.numel].view(shape)

    def _module_buckets(self, model, local: list[LocalParam]):
        """The modules a forward enters in model order, with the buckets their parameters touch."""
        by_param = {id(lp.param): lp for lp in local}
        modules = []
        for name in ("embedding",):
            if getattr(model, name, None) is not None:
                modules.append(getattr(model, name))
        decoder = getattr(model, "decoder", None)
        if decoder is not None:
            modules += list(decoder.layers)
            if getattr(decoder, "final_layernorm", None) is not None:
                modules.append(decoder.final_layernorm)
        if getattr(model, "output_layer", None) is not None:
            modules.append(model.output_layer)
        # whole canonical tensors, not this rank's slices: every rank of a replica must wait
        # for the same buckets before the same module, or a TP peer that waits longer would
        # hold the others in the module's collectives while they hold back its bucket
        for m in modules:
            names = {by_param[id(p)].canonical for p in m.parameters() if id(p) in by_param}
            tensors = [self.space.tensors[n] for n in names]
            buckets = {b for t in tensors for b in self.sharding.buckets_of(t.offset, t.offset + t.numel)}
            if buckets:
                yield m, buckets

    def _gather_stage_runs(self) -> dict:
        """Every rank's runs for every replica type it plays: O(tensors) per rank, once."""
        mine = {rep: stage.runs for rep, stage in self.stages.items()}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        return {(rep, r): runs for r, per_rank in enumerate(everyone) for rep, runs in per_rank.items()}

    def _decay_runs(self) -> list[tuple[int, int, bool, bool]]:
        """(shard start, shard end, no_weight_decay, embedding_or_output) of this rank's shard:
        megatron-core's param groups (the last flag: the tensors --decoupled-lr applies to,
        those megatron-core marks `is_embedding_or_output_parameter`)."""
        flags = [(t.offset, t.offset + t.numel, t.no_weight_decay, t.name in EMBEDDING_OR_OUTPUT)
                 for t in self.space.tensors.values()]
        out = []
        for piece in self.sharding.pieces(self.rank):
            for s, e, nwd, dec in flags:
                lo, hi = max(s, piece.start), min(e, piece.end)
                if lo < hi:
                    out.append((piece.offset + lo - piece.start, piece.offset + hi - piece.start, nwd, dec))
        merged = []
        for run in out:
            if merged and merged[-1][2:] == run[2:] and merged[-1][1] == run[0]:
                merged[-1] = (merged[-1][0], run[1], run[2], run[3])
            else:
                merged.append(run)
        return merged

    def single_rank_collection(self):
        """Groups of size one: for building the full model (canonical space, references)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        me = self.registry._group((self.rank,))
        return ProcessGroupCollection(tp=me, cp=me, pp=me, tp_cp=me, mp=me, embd=me, pos_embd=me, dp=me,
                                      dp_cp=me, intra_dp_cp=me, tp_dp_cp=me)

    # ------------------------------------------------------------------- memory
    def persistent_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the whole run, by kind (what the cost model charges)."""
        out = {"parameters": self.params.numel() * self.params.element_size(),
               "main_grads": self.main_grads.numel() * 4}
        out.update(self.optimizer.persistent_bytes())
        out["exchange"] = self.exchange.persistent_bytes()
        return out

    # --------------------------------------------------------------- parameters
    def initial_shard(self, seed: int, std: float) -> torch.Tensor:
        """Megatron's init scheme, drawn per canonical tensor chunk from its own seeded
        stream, so the initial model is the same whatever the world size or layout."""
        shard = torch.empty(self.sharding.shard_numel(self.rank), dtype=torch.float32, device=self.device)
        if self.device.type == "meta":
            return shard
        for t in self.space.tensors.values():
            for piece, lo, hi in self.sharding.overlaps(self.rank, t.offset, t.offset + t.numel):
                for c in range((lo - t.offset) // INIT_CHUNK, (hi - 1 - t.offset) // INIT_CHUNK + 1):
                    c0 = t.offset + c * INIT_CHUNK
                    values = init_values(t.name, c, min(INIT_CHUNK, t.offset + t.numel - c0), seed, std,
                                         self.num_layers, norm_init=self.norm_init)
                    a, b = max(lo, c0), min(hi, c0 + values.numel())
                    shard[piece.offset + a - piece.start : piece.offset + b - piece.start] = values[a - c0 : b - c0]
        return shard

    def set_canonical(self, flat: torch.Tensor, reset_optimizer: bool = False) -> None:
        """Replace the master parameters by a full canonical vector (tests, imports);
        optionally start the optimizer state afresh."""
        shard = self.sharding.shard_of(flat.to(self.device).float(), self.rank)
        if reset_optimizer:
            self.optimizer = ShardedOptimizer(shard, self._decay_runs(), self.optimizer.options)
            self.optimizer.grad_scaler = self.grad_scaler
        else:
            self.optimizer.set_master(shard)

    def gather_tensor(self, shard: torch.Tensor, tensor, dst: int) -> torch.Tensor | None:
        """One canonical tensor's values assembled on rank `dst` from every rank's shard
        (collective; checkpoints: O(tensor) memory, never the whole model). None elsewhere."""
        pieces = [list(self.sharding.overlaps(r, tensor.offset, tensor.offset + tensor.numel))
                  for r in range(self.world)]
        sizes = [sum(hi - lo for _, lo, hi in p) for p in pieces]
        send = torch.zeros(max(sizes), dtype=shard.dtype, device=shard.device)
        o = 0
        for piece, lo, hi in pieces[self.rank]:
            send[o : o + hi - lo] = shard[piece.offset + lo - piece.start : piece.offset + hi - piece.start]
            o += hi - lo
        parts = [torch.empty_like(send) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(send, parts, dst=dst)
        if self.rank != dst:
            return None
        out = torch.empty(tensor.numel, dtype=shard.dtype, device=shard.device)
        for r in range(self.world):
            o = 0
            for piece, lo, hi in pieces[r]:
                out[lo - tensor.offset : hi - tensor.offset] = parts[r][o : o + hi - lo]
                o += hi - lo
        return out.view(tensor.shape)

    def gather_canonical(self) -> torch.Tensor:
        """The whole master vector on every rank (collective; checkpoints export, tests)."""
        return self.exchange.allgather(self.optimizer.master())

    # --------------------------------------------------------------------- step
    def my_replica(self, it: IterationPlan):
        return it.replica_of(self.rank)

    def padding_for(self, rep: ReplicaType, replica=None) -> tuple[int, int]:
        """(pad_each_to, pad_total_to) a micro-batch needs under this replica type (and,
        given the replica's plan, under every layer strategy its micro-batches use)."""
        stage = self.stages[rep]
        strategies = {(rep.tp, rep.cp)} | {(s.tp, s.cp) for mb in (replica.micro_batches if replica else ())
                                           for s in mb.layer_strategies or ()}
        cp = math.lcm(*(c for _, c in strategies))
        each = 2 * cp if cp > 1 else 1
        sp = self.sequence_parallel and any(t > 1 for t, _ in strategies)  # the home one included
        total = rep.tp * rep.cp if sp else 1
        return each, total

    def train_iteration(self, it: IterationPlan, dataset, *, eod_mask_loss: bool = False,
                        eod: int | None = None) -> StepResult:
        """One training step of the plan on a document dataset: this rank's micro-batches are
        fetched, packed, padded and localised here, the loss divisor is the global batch's
        loss-token count. Raises NoTrainableTokens if the global batch has none."""
        with self.phase("dcp-fetch-pack"):
            loss_tokens = num_loss_tokens(dataset, it.sample_ids, eod_mask_loss, eod)
            if loss_tokens == 0:
                raise NoTrainableTokens(f"iteration {it.index}: no token of the global batch is trained on")
            stage, plans, batches = self._packed(it, dataset, eod_mask_loss, eod)
            local = self._localize(stage, plans, batches, self.my_replica(it))
        return self._step(it, stage, local, loss_tokens)

    def eval_iteration(self, it: IterationPlan, dataset, *, eod_mask_loss: bool = False,
                       eod: int | None = None) -> tuple[float, float]:
        """Forward only under the plan's layout on a document dataset: (loss sum, loss tokens)."""
        stage, plans, batches = self._packed(it, dataset, eod_mask_loss, eod)
        return self._evaluate(it, stage, self._localize(stage, plans, batches, self.my_replica(it)))

    def step(self, it: IterationPlan, batches: list, loss_tokens: int) -> StepResult:
        """One training step on micro-batches packed by the caller (ThdBatch, plan order,
        padded per `padding_for`); `loss_tokens`: the global batch's loss-token count."""
        stage, plans = self._stage_of(it)
        return self._step(it, stage, self._localize(stage, plans, batches, self.my_replica(it)), loss_tokens)

    def evaluate(self, it: IterationPlan, batches: list) -> tuple[float, float]:
        """Forward only on micro-batches packed by the caller: (loss sum, loss tokens)."""
        stage, plans = self._stage_of(it)
        return self._evaluate(it, stage, self._localize(stage, plans, batches, self.my_replica(it)))

    def _stage_of(self, it: IterationPlan) -> tuple[Stage, list]:
        """This rank's stage for the iteration and its replica's micro-batch plans."""
        replica = self.my_replica(it)
        if replica.replica_type not in self.stages:
            raise KeyError(f"iteration {it.index}: replica {replica.replica_type} was not registered at start")
        if any(mb.layer_strategies for mb in replica.micro_batches) and replica.replica_type not in self.alternatives:
            raise KeyError(f"iteration {it.index}: the plan gives layer strategies but the engine was built without "
                           "layer_strategies")
        return self.stages[replica.replica_type], replica.micro_batches

    def _packed(self, it: IterationPlan, dataset, eod_mask_loss: bool, eod: int | None) -> tuple[Stage, list, list]:
        """The replica's micro-batches fetched from the dataset and packed as its type needs."""
        stage, plans = self._stage_of(it)
        each, total = self.padding_for(stage.rep, self.my_replica(it))
        return stage, plans, [materialize(dataset, mb.sample_ids, pad_each_to=each, pad_total_to=total,
                                          eod_mask_loss=eod_mask_loss, eod=eod) for mb in plans]

    def _localize(self, stage: Stage, plans: list, batches: list, replica=None) -> list:
        """This rank's CP chunk and TP slice of each micro-batch, on the device, with the
        strategy of each of its stage's layers when the plan switches them."""
        _, c, p = stage.rep.coords(self.rank)
        hidden = stage.runner.config.hidden_size
        out = []
        for b, mb in zip(batches, plans):
            local = localize(b, stage.rep.cp, c, stage.rep.tp, stage.sequence_parallel, hidden, mb.recompute_layers,
                             device=self.device)
            if replica is not None:
                local.strategies = stage_strategies(mb, replica, p, self.num_layers)
            out.append(local)
        return out

    def _layout_plan(self, it: IterationPlan, needs: tuple = ()):
        if not any(n for per_replica in needs for n in per_replica):
            needs = ()
        key = (it.layout_key(), tuple((r.replica_type, n) for r, n in zip(it.replicas, needs))) if needs else it.layout_key()
        return self.exchange.plan(key, lambda: switched_layout(it, needs, self._all_runs, self._alt_runs, self.world))

    def _reduce(self, stage: Stage, loss_sum: float, tokens: float, moved: float, waited: float) -> list[float]:
        """Every token's loss once (last stages, TP rank 0: TP ranks hold identical losses),
        bytes moved summed, the longest and the shortest wait: one all-gather, summed in rank order."""
        counts = stage.runner.last and stage.rep.coords(self.rank)[0] == 0
        mine = torch.tensor([loss_sum if counts else 0.0, tokens if counts else 0.0, moved, waited],
                            dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        every = torch.stack(every).cpu()
        return every[:, :3].sum(0).tolist() + [float(every[:, 3].max()), float(every[:, 3].min())]

    def _begin_pull(self, it: IterationPlan, stage: Stage):
        """Bind this iteration's alternative layers, start the pull; (exchange plan, elements
        in use, push buckets per parameter)."""
        # per replica, per stage: the alternative-strategy layers the iteration uses
        needs = tuple(switch_needs(r, self.num_layers) for r in it.replicas) if self._alt_runs else ()
        mine = needs[it.replicas.index(self.my_replica(it))][stage.runner.pp_rank] if needs else ()
        numel, extra_buckets = bind_alternatives(self, stage, mine) if stage.rep in self.alternatives else (
            stage.numel, [])
        plan = self._layout_plan(it, needs)
        self._pull = PullStream(self.exchange, plan, self.optimizer.master(), self.params, self.overlap)
        return plan, numel, stage.push_buckets + extra_buckets

    def _evaluate(self, it: IterationPlan, stage: Stage, micro_batches: list) -> tuple[float, float]:
        seed_rng_tracker(self.init_seed, it.index, stage.rep.coords(self.rank)[0])
        self._begin_pull(it, stage)
        try:
            loss_sum, tokens = stage.runner.evaluate(micro_batches, self._pull)
            self._pull.drain()
        finally:
            self._pull = None
        return tuple(self._reduce(stage, loss_sum, tokens, 0.0, 0.0)[:2])

    def _step(self, it: IterationPlan, stage: Stage, micro_batches: list, loss_tokens: int) -> StepResult:
        seed_rng_tracker(self.init_seed, it.index, stage.rep.coords(self.rank)[0])
        moved_before = self.exchange.bytes_pulled + self.exchange.bytes_pushed
        waited_before = self.exchange.wait_s
        t0 = time.perf_counter()
        with self.phase("dcp-pull"):
            plan, numel, push_buckets = self._begin_pull(it, stage)
        sync_s = time.perf_counter() - t0 if not self.overlap else 0.0
        self.main_grads[:numel].zero_()
        self.optimizer.zero_grad()
        scale = float(self.grad_scaler.scale.item()) if self.grad_scaler is not None else 1.0
        self._push = PushStream(self.exchange, plan, self.main_grads, self.optimizer.grad, push_buckets,
                                self.overlap)
        clock = PhaseClock(self.device, len(micro_batches))
        try:
            with self.phase("forward-backward"):
                loss_sum, tokens = stage.runner.run(micro_batches, scale / max(loss_tokens, 1), self._pull,
                                                    self._push, clock)
                self._pull.drain()
            t1 = time.perf_counter()
            with self.phase("dcp-push"):
                self._push.finish()
            if not self.overlap:
                sync_s += time.perf_counter() - t1
        finally:
            self._pull = self._push = None
        timings = LocalTimings(it.replicas.index(self.my_replica(it)), stage.runner.pp_rank, clock.seconds(), sync_s,
                               time.perf_counter() - t0)
        with self.phase("optimizer"):
            if self.grad_scaler is not None:
                self.optimizer.unscale(1.0 / scale)
            ok, norm = self.optimizer.step()
            if self.grad_scaler is not None:
                self.grad_scaler.update(not ok)
        moved = self.exchange.bytes_pulled + self.exchange.bytes_pushed - moved_before
        waited = sync_s if not self.overlap else self.exchange.wait_s - waited_before
        with self.phase("dcp-reduce"):
            total_loss, total_tokens, total_moved, worst_wait, least_wait = self._reduce(stage, loss_sum, tokens, moved,
                                                                                         waited)
        return StepResult(total_loss, total_tokens, norm, ok, total_moved, worst_wait, scale, timings,
                          exchange_s=least_wait)

    # ----------------------------------------------------------------- hooks
    def _pull_hook(self, bucket: int):
        def hook(module, args):
            if self._pull is not None:
                self._pull.need(bucket)
        return hook

    def _grad_hook(self, lp: LocalParam, buckets: list[int]):
        def hook(param):
            param.main_grad.add_(param.grad)
            param.grad = None
            if self._push is not None and self._push.tracking and lp.pushes_grad:
                self._push.ready(buckets)
        return hook

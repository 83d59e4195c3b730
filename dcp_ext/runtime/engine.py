"""The adaptive engine: one training step under whatever layout the plan names.

Built once per run from the planner's finite set of replica types:
- process groups of every replica type (GroupRegistry);
- on each rank, the megatron-core GPTModel stage it plays in every replica type it
  belongs to, built with that replica's groups passed explicitly (no global
  parallel_state), and the index map of its parameters into the canonical space;
- the fixed optimizer sharding (ShardedAdamW) and the pull/push exchange.
A step: pull the parameters of this iteration's stage, run the replica's micro-batches
(1F1B, THD, CP), push gradients to their owner shards, clip on the global norm, AdamW.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dcp_ext import mcore_compat
from dcp_ext.plan import IterationPlan
from dcp_ext.runtime.exchange import ParamExchange
from dcp_ext.runtime.executor import StageRunner, localize
from dcp_ext.runtime.groups import GroupRegistry, ReplicaType
from dcp_ext.runtime.param_map import CanonicalSpace, LocalParam, map_stage
from dcp_ext.runtime.sharded_optimizer import ShardedAdamW, shard_bounds


@dataclass
class Stage:
    rep: ReplicaType
    runner: StageRunner
    local: list[LocalParam]
    sequence_parallel: bool


@dataclass
class StepResult:
    loss_sum: float  # summed over the global batch (every token once)
    loss_tokens: float
    grad_norm: float
    update_successful: bool
    bytes_moved: float = 0.0  # pull + push, all ranks together, this step

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.loss_tokens, 1.0)


def layout_key(it: IterationPlan) -> tuple:
    return tuple(sorted((tuple(r.ranks), r.tp, r.cp, r.pp) for r in it.replicas))


def replica_type_of(r) -> ReplicaType:
    return ReplicaType(r.tp, r.cp, r.pp, tuple(r.ranks))


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
    ):
        """make_config(tp, cp, pp, sequence_parallel) -> TransformerConfig;
        build_model(config, pre_process, post_process, pg_collection) -> GPTModel stage."""
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.init_seed = init_seed
        mcore_compat.ensure_global_memory_buffer()
        self.registry = GroupRegistry(replica_types)
        self.make_config = make_config
        # The canonical space: the full model, built on the meta device (no memory).
        full_config = make_config(1, 1, 1, False)
        self.num_layers = full_config.num_layers
        self.gated = bool(full_config.gated_linear_unit)
        single = self.single_rank_collection()
        with torch.device("meta"):
            full = build_model(full_config, True, True, single)
        self.space = CanonicalSpace(full)
        del full
        # This rank's stage in every replica type it belongs to.
        self.stages: dict[ReplicaType, Stage] = {}
        for rep in self.registry.replica_types:
            if self.rank not in rep.ranks:
                continue
            sp = sequence_parallel and rep.tp > 1
            config = make_config(rep.tp, rep.cp, rep.pp, sp)
            tp_rank, _, pp_rank = rep.coords(self.rank)
            model = build_model(config, pp_rank == 0, pp_rank == rep.pp - 1, self.registry.collection(rep))
            local = map_stage(model, self.space, rep.tp, tp_rank, self.gated)
            self.stages[rep] = Stage(rep, StageRunner(model, config, rep, self.rank, self.num_layers), local, sp)
        # The fixed sharding.
        self.bounds = shard_bounds(self.space.numel, self.world)
        start, end = self.bounds[self.rank]
        self.optimizer = ShardedAdamW(
            self.initial_shard(init_seed, init_std),
            self.space.no_weight_decay_mask()[start:end],
            lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, clip_grad=clip_grad,
        )
        self.exchange = ParamExchange(self.bounds, self.space.numel, mode=exchange)

    def single_rank_collection(self):
        """Groups of size one: for building the full model (canonical space, references)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        me = self.registry._group((self.rank,))
        return ProcessGroupCollection(tp=me, cp=me, pp=me, tp_cp=me, mp=me, embd=me, pos_embd=me, dp=me,
                                      dp_cp=me, intra_dp_cp=me, tp_dp_cp=me)

    # --------------------------------------------------------------- parameters
    def initial_shard(self, seed: int, std: float) -> torch.Tensor:
        """Megatron's init scheme, drawn per canonical tensor from its own seeded stream, so
        the initial model is the same whatever the world size or layout."""
        start, end = self.bounds[self.rank]
        shard = torch.empty(end - start, dtype=torch.float32)
        for t in self.space.tensors.values():
            lo, hi = max(start, t.offset), min(end, t.offset + t.numel)
            if lo >= hi:
                continue
            shard[lo - start : hi - start] = init_values(t.name, t.numel, seed, std, self.num_layers)[
                lo - t.offset : hi - t.offset]
        return shard

    def set_canonical(self, flat: torch.Tensor, reset_optimizer: bool = False) -> None:
        """Replace the master parameters by a full canonical vector (tests, imports);
        optionally start the optimizer state afresh."""
        start, end = self.bounds[self.rank]
        if reset_optimizer:
            old = self.optimizer
            self.optimizer = ShardedAdamW(flat[start:end].float(), self.space.no_weight_decay_mask()[start:end],
                                          lr=old.inner.defaults["lr"], weight_decay=old.inner.defaults["weight_decay"],
                                          betas=old.inner.defaults["betas"], eps=old.inner.defaults["eps"],
                                          clip_grad=old.clip_grad)
        else:
            self.optimizer.set_master(flat[start:end].float())

    def gather_canonical(self) -> torch.Tensor:
        """The whole master vector on every rank (collective; checkpoints export, tests)."""
        return self.exchange.allgather(self.optimizer.master())

    # --------------------------------------------------------------------- step
    def my_replica(self, it: IterationPlan):
        for r in it.replicas:
            if self.rank in r.ranks:
                return r
        raise ValueError(f"iteration {it.index}: rank {self.rank} is in no replica")

    def stage_for(self, it: IterationPlan) -> Stage:
        rep = replica_type_of(self.my_replica(it))
        if rep not in self.stages:
            raise KeyError(f"iteration {it.index}: replica {rep} was not registered at start")
        return self.stages[rep]

    def padding_for(self, rep: ReplicaType) -> tuple[int, int]:
        """(pad_each_to, pad_total_to) a micro-batch needs under this replica type."""
        stage = self.stages[rep]
        each = 2 * rep.cp if rep.cp > 1 else 1
        total = rep.tp * rep.cp if stage.sequence_parallel else 1
        return each, total

    def _localize(self, it: IterationPlan, stage: Stage, batches: list) -> list:
        _, c, _ = stage.rep.coords(self.rank)
        hidden = stage.runner.config.hidden_size
        return [
            localize(b, stage.rep.cp, c, stage.rep.tp, stage.sequence_parallel, hidden, mb.recompute_layers)
            for b, mb in zip(batches, self.my_replica(it).micro_batches)
        ]

    def _reduce_loss(self, stage: Stage, loss_sum: float, tokens: float, moved: float = 0.0) -> list[float]:
        """Every token's loss once (last stages, TP rank 0: TP ranks hold identical losses),
        and whatever else every rank adds (bytes moved)."""
        counts = stage.runner.last and stage.rep.coords(self.rank)[0] == 0
        total = torch.tensor([loss_sum if counts else 0.0, tokens if counts else 0.0, moved], dtype=torch.float64)
        dist.all_reduce(total)
        return total.tolist()

    def evaluate(self, it: IterationPlan, batches: list) -> tuple[float, float]:
        """Forward only under the plan's layout: (loss sum, loss tokens) over the batch."""
        stage = self.stage_for(it)
        self.exchange.pull(layout_key(it), stage.local, self.optimizer.master())
        seed_rng_tracker(self.init_seed, it.index, stage.rep.coords(self.rank)[0])
        return tuple(self._reduce_loss(stage, *stage.runner.evaluate(self._localize(it, stage, batches)))[:2])

    def step(self, it: IterationPlan, batches: list, loss_tokens: int) -> StepResult:
        """One training step. `batches`: this rank's replica's micro-batches (ThdBatch, plan
        order), padded per `padding_for`; `loss_tokens`: the global batch's loss-token count."""
        stage = self.stage_for(it)
        key = layout_key(it)
        seed_rng_tracker(self.init_seed, it.index, stage.rep.coords(self.rank)[0])
        moved_before = self.exchange.bytes_pulled + self.exchange.bytes_pushed
        self.exchange.pull(key, stage.local, self.optimizer.master())
        for lp in stage.local:
            lp.param.grad = None
        loss_sum, tokens = stage.runner.run(self._localize(it, stage, batches), 1.0 / max(loss_tokens, 1))
        self.optimizer.zero_grad()
        self.exchange.push(key, stage.local, self.optimizer.grad)
        ok, norm = self.optimizer.step()
        moved = self.exchange.bytes_pulled + self.exchange.bytes_pushed - moved_before
        total_loss, total_tokens, total_moved = self._reduce_loss(stage, loss_sum, tokens, moved)
        return StepResult(total_loss, total_tokens, norm, ok, total_moved)


def seed_rng_tracker(seed: int, iteration: int, tp_rank: int) -> None:
    """megatron-core's model-parallel RNG tracker is one global; its streams depend on the TP
    rank, which changes with the layout, so it is re-seeded for every step (Megatron's
    offsets: +2718 per TP rank for the model-parallel stream)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    base = seed + 1_000_003 * iteration
    tracker.add("model-parallel-rng", base + 2718 + tp_rank)
    tracker.add("data-parallel-rng", base)
    tracker.add("expert-parallel-rng", base + 1024 + tp_rank)


def init_values(name: str, numel: int, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """Megatron's defaults: norms 1, biases 0, output projections N(0, std/sqrt(2L)), else N(0, std)."""
    if name.endswith(".bias"):
        return torch.zeros(numel)
    if "norm" in name.rsplit(".", 2)[-2] or name.endswith("layer_norm_weight"):
        return torch.ones(numel)
    scaled = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
    sigma = std / math.sqrt(2.0 * num_layers) if scaled else std
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(numel, generator=gen) * sigma

"""The stage bank: every stage this rank can play, built once, sharing two buffers.

Why it exists: a rank plays one stage per iteration, of whichever replica type the plan
puts it in. The bank builds, at start, its megatron-core stage in every replica type it
belongs to (and, with layer-wise strategies, the decoder-only alternatives of each),
with that type's process groups passed explicitly. The pull fills whichever stage runs,
so all share storage: one parameter buffer (compute dtype) and one fp32 main-grad
buffer, sized to the largest stage; every stage's parameters and `.main_grad`s are views
into them, and a new replica type costs no parameter memory. The largest stages
(smallest tp*pp) are built first, so the buffers rarely grow.

The stages' hooks tie them to one step's streams: a module's pre-forward hook waits for
the buckets it needs, a parameter's post-accumulate hook adds its gradient to the fp32
main grad and tells the push stream. The streams exist only inside `streaming()`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from dcp_ext.planning.layout import ReplicaType
from dcp_ext.runtime.params.param_map import CanonicalSpace, LocalParam, map_stage
from dcp_ext.runtime.schedule.executor import StageRunner
from dcp_ext.runtime.schedule.layer_switch import SwitchContext
from dcp_ext.runtime.stages.alternatives import (AltStage, alternative_types, apply_stage_layers,
                                                 gather_alternative_runs, split_by_layer, switched_layout)
from dcp_ext.runtime.host_device import reads_lengths_on_host
from dcp_ext.runtime.stages.groups import GroupRegistry
from dcp_ext.runtime.stages.meta_build import build_without_parameters, materialize


@dataclass
class Stage:
    rep: ReplicaType
    model: torch.nn.Module
    config: object
    local: list[LocalParam]
    sequence_parallel: bool
    numel: int
    runs: list = field(default_factory=list)  # (runs in buffer coordinates, pushes_grad) per parameter
    push_buckets: list = field(default_factory=list)  # per parameter: buckets its gradient pushes into
    runner: StageRunner | None = None  # made once every alternative exists
    lengths_on_host: bool = True  # its layers read cu_seqlens on the host (host_device.reads_lengths_on_host)


class StepStreams:
    """The pull and push streams of the step in progress (None between steps)."""
    pull = None
    push = None


class StageBank:
    def __init__(self, replica_types: Sequence[ReplicaType], make_config: Callable, build_model: Callable, *,
                 device: torch.device, sequence_parallel: bool, layer_strategies: bool, forward_step=None):
        """make_config(tp, cp, pp, sequence_parallel) -> TransformerConfig;
        build_model(config, pre_process, post_process, pg_collection) -> GPTModel stage.
        Creates every process group (collective, once) and the canonical space (the full
        model on the meta device); `build` then builds this rank's stages."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device, self.sequence_parallel = device, sequence_parallel
        self.make_config, self.build_model, self.forward_step = make_config, build_model, forward_step
        full_config = make_config(1, 1, 1, False)
        self.num_layers = full_config.num_layers
        self.gated = bool(full_config.gated_linear_unit)
        self.param_dtype = full_config.params_dtype or torch.float32
        self.norm_init = 0.0 if full_config.layernorm_zero_centered_gamma else 1.0
        self.planned = sorted(set(replica_types), key=ReplicaType.sort_key)
        heads = full_config.num_attention_heads
        self.refactorings = {rep: alternative_types(rep, heads, full_config.num_query_groups or heads)
                             for rep in self.planned} if layer_strategies else {}
        self.registry = GroupRegistry(self.planned + [a for alts in self.refactorings.values() for a in alts],
                                      host_group=device.type == "cuda")
        full = build_without_parameters(
            lambda: build_model(full_config, True, True, self.registry.single_rank_collection()))
        self.space = CanonicalSpace(full)
        self.params = torch.empty(0, dtype=self.param_dtype, device=device)
        self.main_grads = torch.empty(0, dtype=torch.float32, device=device)
        self.stages: dict[ReplicaType, Stage] = {}
        self.alternatives: dict[ReplicaType, dict] = {}
        self.streams = StepStreams()

    def build(self, sharding) -> None:
        """This rank's stage in every replica type it belongs to, then its alternatives;
        every rank's runs gathered once (collective)."""
        self.sharding = sharding
        mine = [rep for rep in self.planned if self.rank in rep.ranks]
        for rep in sorted(mine, key=lambda r: r.tp * r.pp):
            self.stages[rep] = self._build_stage(rep)
        mine_runs = {rep: stage.runs for rep, stage in self.stages.items()}
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine_runs)
        self.all_runs = {(rep, r): runs for r, per_rank in enumerate(everyone) for rep, runs in per_rank.items()}
        for rep in mine if self.refactorings else ():
            self.alternatives[rep] = {(a.tp, a.cp): self._build_alternative(a) for a in self.refactorings[rep]}
        self.alt_runs = gather_alternative_runs(self.alternatives, self.world) if self.refactorings else {}
        for rep, stage in self.stages.items():
            switching = (SwitchContext.for_stage(stage.rep, stage.model.decoder.layers, self.alternatives[rep],
                                                 self.registry, self.rank, self.sequence_parallel)
                         if rep in self.alternatives else None)
            stage.runner = StageRunner(stage.model, stage.config, rep, self.rank, self.num_layers, switching,
                                       self.forward_step)

    # ------------------------------------------------------------------- building
    def config(self, rep: ReplicaType):
        config = self.make_config(rep.tp, rep.cp, rep.pp, self.sequence_parallel and rep.tp > 1)
        apply_stage_layers(config, rep.stage_layers)
        return config

    def _model(self, rep: ReplicaType, config, whole_stage: bool):
        """The rank's stage of `rep`, its parameters on the meta device until bound."""
        tp_rank, _, pp_rank = rep.coords(self.rank)
        pre, post = (pp_rank == 0, pp_rank == rep.pp - 1) if whole_stage else (False, False)
        return build_without_parameters(lambda: self.build_model(config, pre, post, self.registry.collection(rep)))

    def _push_buckets(self, lp: LocalParam) -> list[int]:
        """The buckets a parameter's gradient holds back: those of its whole canonical tensor
        (not this rank's slice, which a bucket boundary can put elsewhere on each TP rank),
        whether or not this rank sends it (a TP replica of a norm is sent by TP rank 0
        only). So a bucket goes out at the same point of the backward on every rank of a
        replica, which NCCL needs: ranks must issue their collectives over two communicators
        in one order (tests/runtime/test_device_paths.py checks it)."""
        t = self.space.tensors[lp.canonical]
        return sorted(self.sharding.buckets_of(t.offset, t.offset + t.numel))

    def _build_stage(self, rep: ReplicaType) -> Stage:
        config = self.config(rep)
        model = self._model(rep, config, whole_stage=True)
        local = map_stage(model, self.space, rep.tp, rep.coords(self.rank)[0], self.gated)
        numel = sum(lp.numel for lp in local)
        if numel > self.params.numel():
            self._grow_buffers(numel)
        stage = Stage(rep, model, config, local, self.sequence_parallel and rep.tp > 1, numel,
                      lengths_on_host=reads_lengths_on_host(model))
        self._bind(stage)
        for lp in local:
            stage.runs.append((tuple(r.shifted(lp.offset) for r in lp.runs), lp.pushes_grad))
            stage.push_buckets.append(self._push_buckets(lp))
            lp.param.register_post_accumulate_grad_hook(self._grad_hook(lp, stage.push_buckets[-1]))
        self._hook_modules(model, local)
        return stage

    def _build_alternative(self, rep: ReplicaType) -> AltStage:
        """The rank's decoder-only stage of `rep` (a home stage's ranks re-factored), with
        the bank's hooks, holding no memory until bound."""
        model = self._model(rep, self.config(rep), whole_stage=False)
        first, end = rep.stage_range(rep.coords(self.rank)[2], self.num_layers)
        local = map_stage(model, self.space, rep.tp, rep.coords(self.rank)[0], self.gated)
        shapes = {lp.name: lp.param.shape for lp in local}
        self._materialize(model, local)  # empty until an iteration binds its layers
        alt = AltStage((rep.tp, rep.cp), rep, model, split_by_layer(local, end - first))
        for per_layer in alt.layers:
            alt.buckets.append([])
            for lp in per_layer:
                alt.shapes[id(lp.param)] = shapes[lp.name]
                alt.buckets[-1].append(self._push_buckets(lp))
                lp.param.register_post_accumulate_grad_hook(self._grad_hook(lp, alt.buckets[-1][-1]))
        self._hook_modules(model, local)
        alt.unbind(self.params, every=True)
        return alt

    def _grow_buffers(self, numel: int) -> None:
        self.params = torch.empty(numel, dtype=self.param_dtype, device=self.device)
        self.main_grads = torch.zeros(numel, dtype=torch.float32, device=self.device)
        for stage in self.stages.values():  # rebind the smaller stages built before
            self._bind(stage)

    def _bind(self, stage: Stage) -> None:
        shapes = [lp.param.shape for lp in stage.local]
        if any(lp.param.is_meta for lp in stage.local):
            self._materialize(stage.model, stage.local)  # its first binding
        for lp, shape in zip(stage.local, shapes):
            lp.param.data = self.params[lp.offset : lp.offset + lp.numel].view(shape)
            lp.param.main_grad = self.main_grads[lp.offset : lp.offset + lp.numel].view(shape)

    def _materialize(self, model, local: list[LocalParam]) -> None:
        """The stage's meta parameters become empty Parameters on the bank's device, to be
        bound (LocalParams follow); on the meta device (scale checks) they stay as built."""
        if self.device.type == "meta":
            return
        made = materialize(model, {id(lp.param): self.params for lp in local})
        for lp in local:
            lp.param = made.get(id(lp.param), lp.param)

    def _hook_modules(self, model, local: list[LocalParam]) -> None:
        """Each module a forward enters waits, before it runs, for the last bucket its
        parameters touch. Whole canonical tensors, not this rank's slices: every rank of a
        replica must wait for the same buckets before the same module, or a TP peer that
        waits longer would hold the others in the module's collectives while they hold
        back its bucket."""
        by_param = {id(lp.param): lp for lp in local}
        modules = [model.embedding] if getattr(model, "embedding", None) is not None else []
        decoder = getattr(model, "decoder", None)
        if decoder is not None:
            modules += list(decoder.layers)
            if getattr(decoder, "final_layernorm", None) is not None:
                modules.append(decoder.final_layernorm)
        if getattr(model, "output_layer", None) is not None:
            modules.append(model.output_layer)
        for m in modules:
            names = {by_param[id(p)].canonical for p in m.parameters() if id(p) in by_param}
            tensors = [self.space.tensors[n] for n in names]
            buckets = {b for t in tensors for b in self.sharding.buckets_of(t.offset, t.offset + t.numel)}
            if buckets:
                m.register_forward_pre_hook(self._pull_hook(max(buckets)))

    # ----------------------------------------------------------------- hooks
    def _pull_hook(self, bucket: int):
        def hook(module, inputs):
            if self.streams.pull is not None:
                self.streams.pull.need(bucket)
        return hook

    def _grad_hook(self, lp: LocalParam, buckets: list[int]):
        def hook(param):
            param.main_grad.add_(param.grad)
            param.grad = None
            push = self.streams.push
            if push is not None and push.tracking:
                push.ready(buckets)
        return hook

    @contextlib.contextmanager
    def streaming(self, pull, push=None):
        """The stages' hooks serve these streams for the block (one step's forward/backward)."""
        self.streams.pull, self.streams.push = pull, push
        try:
            yield
        finally:
            self.streams.pull = self.streams.push = None

    # ------------------------------------------------------------- per iteration
    def bind_for(self, stage: Stage, needs) -> tuple[int, list]:
        """This iteration's alternative layers (`needs`: (strategy, stage-local layer) pairs)
        bound after the stage in the shared buffers: (elements in use, every bound
        parameter's push buckets)."""
        alts = self.alternatives.get(stage.rep, {})
        for alt in alts.values():
            alt.unbind(self.params)
        end = stage.numel + sum(alts[s].layer_numel(k) for s, k in needs)
        if end > self.params.numel():
            self._grow_buffers(end)
        offset, buckets = stage.numel, list(stage.push_buckets)
        for s, k in needs:
            offset = alts[s].bind(k, self.params, self.main_grads, offset)
            buckets += alts[s].buckets[k]
        return end, buckets

    def layout(self, it, needs) -> list:
        """Every rank's runs in buffer coordinates for the iteration (`needs`: per replica,
        per stage, the alternative layers it binds; empty when nothing switches)."""
        return switched_layout(it, needs, self.all_runs, self.alt_runs, self.world)

    def persistent_bytes(self) -> dict[str, int]:
        return {"parameters": self.params.numel() * self.params.element_size(),
                "main_grads": self.main_grads.numel() * 4}

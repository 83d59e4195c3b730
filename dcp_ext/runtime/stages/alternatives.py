"""The alternative strategies a stage can switch its layers to, and their per-iteration binding.

Why it exists: with layer-wise strategies (plan contract v2) a stage of replica type R
may run layer k under any re-factoring (tp', cp') of its tp*cp ranks. For each such
strategy the rank holds a decoder-only megatron-core stage (no embedding, no output
layer) built under that strategy's groups. Its parameters take memory only for the
layers an iteration uses in that strategy: each iteration they are bound, layer by
layer, into the rank's shared buffers after the home stage, and only those layers are
pulled and pushed. Everything here is derived from the plan alone, so every rank lays
out every peer's buffers the same way without talking (runs are gathered once at start).

Uneven pipeline stages (`stage_layers`) are given to megatron-core as its first- and
last-stage layer counts (its pipeline layout string needs the global parallel state).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcp_ext.planning.layout import ReplicaType
from dcp_ext.runtime.schedule.layer_switch import Strategy, factorizations
from dcp_ext.runtime.params.param_map import LAYER_PARAM, LocalParam


def apply_stage_layers(config, stage_layers) -> None:
    """Give megatron-core an uneven split through its first/last-stage layer counts (the
    stages OmniBal rebalances: they also carry the embedding and the logits). Middle
    stages share the rest evenly, so a split must be [first, m, ..., m, last]."""
    if not stage_layers or len(set(stage_layers)) == 1:
        return
    first, middle, last = stage_layers[0], stage_layers[1:-1], stage_layers[-1]
    if len(set(middle)) > 1:
        raise ValueError(f"stage_layers {list(stage_layers)}: the middle stages must hold equal layer counts "
                         "(megatron-core's uneven split moves only the first and the last)")
    if sum(stage_layers) != config.num_layers:
        raise ValueError(f"stage_layers {list(stage_layers)} sum to {sum(stage_layers)}, "
                         f"the model has {config.num_layers} layers")
    config.num_layers_in_first_pipeline_stage = first
    config.num_layers_in_last_pipeline_stage = last


def alternative_types(rep: ReplicaType, heads: int, groups: int) -> list[ReplicaType]:
    """`rep` re-factored every other way its stage's tp*cp ranks allow."""
    return [rep.refactored(a, b) for a, b in factorizations(rep.tp * rep.cp, heads, groups) if (a, b) != (rep.tp, rep.cp)]


@dataclass
class AltStage:
    """One alternative strategy of one home stage: its decoder-only model, per layer."""
    strategy: Strategy
    rep: ReplicaType
    model: torch.nn.Module
    layers: list[list[LocalParam]]  # per stage-local layer; offsets relative to the layer
    shapes: dict[int, torch.Size] = field(default_factory=dict)
    buckets: list[list[list[int]]] = field(default_factory=list)  # per layer, per parameter: push buckets
    bound: set[int] = field(default_factory=set)  # layers bound now

    def layer_numel(self, k: int) -> int:
        return sum(lp.numel for lp in self.layers[k])

    def unbind(self, like: torch.Tensor, every: bool = False) -> None:
        """Hold no memory: the bound layers' (`every`: all) parameters empty until an
        iteration binds their layer again."""
        for k in range(len(self.layers)) if every else sorted(self.bound):
            for lp in self.layers[k]:
                lp.param.data = like.new_empty(0)
                lp.param.main_grad = None
        self.bound.clear()

    def bind(self, k: int, params: torch.Tensor, main_grads: torch.Tensor, offset: int) -> int:
        """Layer k's parameters as views of the buffers from `offset`; returns the end."""
        for lp in self.layers[k]:
            shape = self.shapes[id(lp.param)]
            lp.param.data = params[offset + lp.offset : offset + lp.offset + lp.numel].view(shape)
            lp.param.main_grad = main_grads[offset + lp.offset : offset + lp.offset + lp.numel].view(shape)
        self.bound.add(k)
        return offset + self.layer_numel(k)


def split_by_layer(local: list[LocalParam], num_stage_layers: int) -> list[list[LocalParam]]:
    """A decoder-only stage's parameters, grouped by stage-local layer, offsets relative to
    the layer's first parameter."""
    out: list[list[LocalParam]] = [[] for _ in range(num_stage_layers)]
    for lp in local:
        m = LAYER_PARAM.match(lp.name)
        if m is None:
            raise ValueError(f"alternative-strategy stage has a non-layer parameter {lp.name}")
        out[int(m.group(1))].append(lp)
    for per_layer in out:
        start = per_layer[0].offset if per_layer else 0
        for lp in per_layer:
            lp.offset -= start
    return out


def switch_needs(replica, num_layers: int) -> tuple[tuple[tuple[Strategy, int], ...], ...]:
    """Per pipeline stage of a replica plan: the (strategy, stage-local layer) pairs other
    than the home strategy that any of its micro-batches uses, in a fixed order."""
    home = (replica.tp, replica.cp)
    bounds = replica.stage_bounds(num_layers)
    needs = [set() for _ in bounds]
    for mb in replica.micro_batches:
        for s in mb.layer_strategies or ():
            if (s.tp, s.cp) == home:
                continue
            for p, (first, end) in enumerate(bounds):
                for layer in range(max(first, s.first), min(end, s.last + 1)):
                    needs[p].add(((s.tp, s.cp), layer - first))
    return tuple(tuple(sorted(n, key=lambda x: (x[1], x[0]))) for n in needs)


def stage_strategies(mb, replica, pp_rank: int, num_layers: int) -> tuple[Strategy, ...] | None:
    """The strategy of each layer of the stage for one micro-batch; None when all are home."""
    if not mb.layer_strategies:
        return None
    home = (replica.tp, replica.cp)
    first, end = replica.stage_bounds(num_layers)[pp_rank]
    out = tuple(mb.strategy_of_layer(layer, home) for layer in range(first, end))
    return None if all(s == home for s in out) else out


# ---------------------------------------------------------------- every rank's runs
def gather_alternative_runs(alternatives: dict, world: int) -> dict:
    """Every rank's alternative layers (runs relative to the layer, numel), gathered once:
    {(home type, strategy, rank): [(per-parameter (runs, pushes_grad)), layer numel] per layer}."""
    mine = {(home, s): [([(tuple(r.shifted(lp.offset) for r in lp.runs), lp.pushes_grad) for lp in per_layer],
                         alt.layer_numel(k)) for k, per_layer in enumerate(alt.layers)]
            for home, alts in alternatives.items() for s, alt in alts.items()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {(home, s, r): layers for r, per_rank in enumerate(everyone) for (home, s), layers in per_rank.items()}


def switched_layout(it, needs, all_runs: dict, alt_runs: dict, world: int) -> list:
    """Every rank's runs in buffer coordinates: its home stage, then (when the iteration
    switches layers, `needs`) the alternative layers it uses, in the order `StageBank.bind_for` binds them."""
    layout = []
    for q in range(world):
        i, r = next((i, r) for i, r in enumerate(it.replicas) if q in r.ranks)
        home = all_runs[(r.replica_type, q)]
        if not needs:
            layout.append(home)
            continue
        runs = list(home)
        base = sum(x.numel for rs, _ in home for x in rs)
        for s, k in needs[i][r.replica_type.coords(q)[2]]:
            per_param, numel = alt_runs[(r.replica_type, s, q)][k]
            runs += [(tuple(x.shifted(base) for x in rs), pushes) for rs, pushes in per_param]
            base += numel
        layout.append(runs)
    return layout

"""The plan contract (`dcp-plan/v2`, reads v1): what the planner emits and the runtime executes.

Pure data: dataclasses, JSON round trip and a validator that states the invariants every
plan must hold (each sample exactly once, replicas partition the world, rank counts match
tp*cp*pp). See docs/contracts.md, "Plan", and docs/design.md, "Plan contract v2".
v2 adds two optional fields: a replica's `stage_layers` (uneven pipeline stages) and a
micro-batch's `layer_strategies` (ParaDySe's per-layer (tp, cp) over the replica's ranks,
re-factored). A plan that uses neither is written as v1, byte for byte as before.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dcp_ext.planning.layout import ReplicaType

SCHEMA_V1 = "dcp-plan/v1"
SCHEMA = "dcp-plan/v2"
SCHEMAS = (SCHEMA_V1, SCHEMA)


@dataclass(frozen=True)
class LayerStrategy:
    """Layers [first, last] (global indices, inclusive) run as (tp, cp) over the replica's ranks."""
    first: int
    last: int
    tp: int
    cp: int

    def to_json(self) -> list:
        return [self.first, self.last, {"tp": self.tp, "cp": self.cp}]

    @classmethod
    def from_json(cls, entry) -> "LayerStrategy":
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[2], dict)):
            raise ValueError(f"layer_strategies entry {entry!r}: expected [first_layer, last_layer, {{\"tp\": a, \"cp\": b}}]")
        return cls(int(entry[0]), int(entry[1]), int(entry[2]["tp"]), int(entry[2]["cp"]))


@dataclass
class MicroBatchPlan:
    sample_ids: list[int]
    recompute_layers: int = 0  # 0 = none; num_layers = full recompute
    layer_strategies: list[LayerStrategy] | None = None  # v2; None = the replica's (tp, cp) everywhere

    def strategy_of_layer(self, layer: int, home: tuple[int, int]) -> tuple[int, int]:
        """(tp, cp) that global `layer` runs under (the replica's own without layer_strategies)."""
        for s in self.layer_strategies or ():
            if s.first <= layer <= s.last:
                return (s.tp, s.cp)
        return home


@dataclass
class ReplicaPlan:
    ranks: list[int]  # Megatron order inside: tp fastest, then cp, then pp
    tp: int
    cp: int
    pp: int
    micro_batches: list[MicroBatchPlan]
    predicted_time_s: float = 0.0
    stage_layers: list[int] | None = None  # v2: layers per pipeline stage; None = even split

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.tp, self.cp, self.pp)

    @property
    def replica_type(self) -> ReplicaType:
        return ReplicaType(self.tp, self.cp, self.pp, tuple(self.ranks),
                           tuple(self.stage_layers) if self.stage_layers else None)

    def stage_bounds(self, num_layers: int) -> list[tuple[int, int]]:
        """[first, end) global layers of every pipeline stage."""
        counts = self.stage_layers or [num_layers // self.pp] * self.pp
        out, first = [], 0
        for n in counts:
            out.append((first, first + n))
            first += n
        return out

    def uses_v2(self) -> bool:
        return bool(self.stage_layers) or any(mb.layer_strategies for mb in self.micro_batches)


@dataclass
class IterationPlan:
    index: int
    sample_ids: list[int]  # the global batch, in data order
    replicas: list[ReplicaPlan]
    predicted_time_s: float = 0.0

    def replica_of(self, rank: int) -> ReplicaPlan:
        for r in self.replicas:
            if rank in r.ranks:
                return r
        raise ValueError(f"iteration {self.index}: rank {rank} is in no replica")

    def layout_key(self) -> tuple[ReplicaType, ...]:
        """The iteration's replica types in a canonical order: equal keys, equal layouts."""
        return tuple(sorted((r.replica_type for r in self.replicas), key=ReplicaType.sort_key))


@dataclass
class Plan:
    cluster: dict[str, Any]
    model: dict[str, Any]
    iterations: list[IterationPlan] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        v2 = any(r.uses_v2() for it in self.iterations for r in it.replicas)
        return {
            "schema": SCHEMA if v2 else SCHEMA_V1,
            "cluster": self.cluster,
            "model": self.model,
            "iterations": [iteration_to_json(it) for it in self.iterations],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Plan":
        if obj.get("schema") not in SCHEMAS:
            raise ValueError(f"plan schema is {obj.get('schema')!r}, expected one of {', '.join(SCHEMAS)}")
        return cls(
            cluster=obj["cluster"],
            model=obj["model"],
            iterations=[iteration_from_json(it) for it in obj["iterations"]],
        )

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(json.load(f))


def iteration_to_json(it: IterationPlan) -> dict[str, Any]:
    # key order of the contract: index, sample_ids, predicted_time_s, replicas; v2 fields
    # only where used, so a v1 plan's JSON is unchanged
    return {
        "index": it.index,
        "sample_ids": list(it.sample_ids),
        "predicted_time_s": it.predicted_time_s,
        "replicas": [replica_to_json(r) for r in it.replicas],
    }


def replica_to_json(r: ReplicaPlan) -> dict[str, Any]:
    out = {"ranks": list(r.ranks), "tp": r.tp, "cp": r.cp, "pp": r.pp, "predicted_time_s": r.predicted_time_s}
    if r.stage_layers:
        out["stage_layers"] = list(r.stage_layers)
    mbs = []
    for mb in r.micro_batches:
        m = {"sample_ids": list(mb.sample_ids), "recompute_layers": mb.recompute_layers}
        if mb.layer_strategies:
            m["layer_strategies"] = [s.to_json() for s in mb.layer_strategies]
        mbs.append(m)
    out["micro_batches"] = mbs
    return out


def iteration_from_json(d: dict[str, Any]) -> IterationPlan:
    return IterationPlan(
        index=int(d["index"]),
        sample_ids=[int(s) for s in d["sample_ids"]],
        predicted_time_s=float(d.get("predicted_time_s", 0.0)),
        replicas=[
            ReplicaPlan(
                ranks=[int(x) for x in r["ranks"]],
                tp=int(r["tp"]),
                cp=int(r["cp"]),
                pp=int(r["pp"]),
                predicted_time_s=float(r.get("predicted_time_s", 0.0)),
                stage_layers=[int(n) for n in r["stage_layers"]] if r.get("stage_layers") else None,
                micro_batches=[
                    MicroBatchPlan([int(s) for s in mb["sample_ids"]], int(mb.get("recompute_layers", 0)),
                                   [LayerStrategy.from_json(e) for e in mb["layer_strategies"]]
                                   if mb.get("layer_strategies") else None)
                    for mb in r["micro_batches"]
                ],
            )
            for r in d["replicas"]
        ],
    )


def validate_iteration(
    it: IterationPlan,
    world_size: int,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
) -> None:
    """Raise ValueError naming the first broken invariant of one iteration's plan."""
    seen_ranks: set[int] = set()
    for i, rep in enumerate(it.replicas):
        if min(rep.tp, rep.cp, rep.pp) < 1:
            raise ValueError(f"iteration {it.index} replica {i}: tp/cp/pp must be >= 1, got {rep.layout}")
        if len(rep.ranks) != rep.tp * rep.cp * rep.pp:
            raise ValueError(
                f"iteration {it.index} replica {i}: {len(rep.ranks)} ranks but tp*cp*pp = {rep.tp * rep.cp * rep.pp}"
            )
        dup = seen_ranks.intersection(rep.ranks)
        if dup:
            raise ValueError(f"iteration {it.index} replica {i}: ranks {sorted(dup)} already used by another replica")
        seen_ranks.update(rep.ranks)
        if num_attention_heads is not None and num_attention_heads % rep.tp:
            raise ValueError(f"iteration {it.index} replica {i}: {num_attention_heads} heads not divisible by tp={rep.tp}")
        if num_query_groups is not None and num_query_groups % rep.tp:
            raise ValueError(f"iteration {it.index} replica {i}: {num_query_groups} query groups not divisible by tp={rep.tp}")
        where = f"iteration {it.index} replica {i}"
        if rep.stage_layers:
            if len(rep.stage_layers) != rep.pp or min(rep.stage_layers) < 1:
                raise ValueError(f"{where}: stage_layers {rep.stage_layers} must give pp={rep.pp} stages of >= 1 layer")
            if len(set(rep.stage_layers[1:-1])) > 1:
                raise ValueError(f"{where}: stage_layers {rep.stage_layers}: the middle stages must hold equal "
                                 "layer counts (only the first and the last stage move)")
            if num_layers is not None and sum(rep.stage_layers) != num_layers:
                raise ValueError(f"{where}: stage_layers {rep.stage_layers} sum to {sum(rep.stage_layers)}, "
                                 f"the model has {num_layers} layers")
        elif num_layers is not None and num_layers % rep.pp:
            raise ValueError(f"{where}: {num_layers} layers not divisible by pp={rep.pp}")
        for mb in rep.micro_batches:
            if not mb.sample_ids:
                raise ValueError(f"iteration {it.index} replica {i}: empty micro-batch")
            if mb.layer_strategies:
                _check_layer_strategies(mb.layer_strategies, rep, where, num_layers, num_attention_heads,
                                        num_query_groups)
            if num_layers is not None and not 0 <= mb.recompute_layers <= num_layers:
                raise ValueError(
                    f"iteration {it.index} replica {i}: recompute_layers {mb.recompute_layers} outside [0, {num_layers}]"
                )
    if seen_ranks != set(range(world_size)):
        missing = sorted(set(range(world_size)) - seen_ranks)
        extra = sorted(seen_ranks - set(range(world_size)))
        raise ValueError(f"iteration {it.index}: replicas do not partition the world (missing {missing}, extra {extra})")
    placed = [s for rep in it.replicas for mb in rep.micro_batches for s in mb.sample_ids]
    if sorted(placed) != sorted(it.sample_ids) or len(set(placed)) != len(placed):
        raise ValueError(f"iteration {it.index}: micro-batches do not hold each sample of the global batch exactly once")


def _check_layer_strategies(strategies: list[LayerStrategy], rep: ReplicaPlan, where: str, num_layers: int | None,
                            num_attention_heads: int | None, num_query_groups: int | None) -> None:
    """Entries contiguous from layer 0, each (tp, cp) a re-factoring of the replica's tp*cp."""
    expected = 0
    for s in strategies:
        if s.first != expected or s.last < s.first:
            raise ValueError(f"{where}: layer_strategies must cover layers 0.. in order without gaps; "
                             f"entry [{s.first}, {s.last}] follows layer {expected - 1}")
        if min(s.tp, s.cp) < 1 or s.tp * s.cp != rep.tp * rep.cp:
            raise ValueError(f"{where}: layer strategy tp{s.tp}·cp{s.cp} for layers [{s.first}, {s.last}] must "
                             f"re-factor the replica's tp*cp = {rep.tp * rep.cp}")
        for what, n in (("heads", num_attention_heads), ("query groups", num_query_groups)):
            if n is not None and n % s.tp:
                raise ValueError(f"{where}: layer strategy tp{s.tp}: {n} {what} not divisible by {s.tp}")
        expected = s.last + 1
    if num_layers is not None and expected != num_layers:
        raise ValueError(f"{where}: layer_strategies cover layers 0..{expected - 1}, the model has {num_layers}")

"""The plan contract (`dcp-plan/v1`): what the planner emits and the runtime executes.

Pure data: dataclasses, JSON round trip and a validator that states the invariants every
plan must hold (each sample exactly once, replicas partition the world, rank counts match
tp*cp*pp). See DESIGN.md, "Plan".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from dcp_ext.planning.layout import ReplicaType

SCHEMA = "dcp-plan/v1"


@dataclass
class MicroBatchPlan:
    sample_ids: list[int]
    recompute_layers: int = 0  # 0 = none; num_layers = full recompute


@dataclass
class ReplicaPlan:
    ranks: list[int]  # Megatron order inside: tp fastest, then cp, then pp
    tp: int
    cp: int
    pp: int
    micro_batches: list[MicroBatchPlan]
    predicted_time_s: float = 0.0

    @property
    def layout(self) -> tuple[int, int, int]:
        return (self.tp, self.cp, self.pp)

    @property
    def replica_type(self) -> ReplicaType:
        return ReplicaType(self.tp, self.cp, self.pp, tuple(self.ranks))


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
        return tuple(sorted((r.replica_type for r in self.replicas), key=lambda t: (t.ranks, t.tp, t.cp, t.pp)))


@dataclass
class Plan:
    cluster: dict[str, Any]
    model: dict[str, Any]
    iterations: list[IterationPlan] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "cluster": self.cluster,
            "model": self.model,
            "iterations": [iteration_to_json(it) for it in self.iterations],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Plan":
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"plan schema is {obj.get('schema')!r}, expected {SCHEMA!r}")
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
    d = asdict(it)
    # key order of the contract: index, sample_ids, predicted_time_s, replicas
    return {
        "index": d["index"],
        "sample_ids": d["sample_ids"],
        "predicted_time_s": d["predicted_time_s"],
        "replicas": [
            {
                "ranks": r["ranks"],
                "tp": r["tp"],
                "cp": r["cp"],
                "pp": r["pp"],
                "predicted_time_s": r["predicted_time_s"],
                "micro_batches": r["micro_batches"],
            }
            for r in d["replicas"]
        ],
    }


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
                micro_batches=[
                    MicroBatchPlan([int(s) for s in mb["sample_ids"]], int(mb.get("recompute_layers", 0)))
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
        if num_layers is not None and num_layers % rep.pp:
            raise ValueError(f"iteration {it.index} replica {i}: {num_layers} layers not divisible by pp={rep.pp}")
        for mb in rep.micro_batches:
            if not mb.sample_ids:
                raise ValueError(f"iteration {it.index} replica {i}: empty micro-batch")
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

"""The layout vocabulary the planner and the runtime share.

Why it exists: a layout (tp, cp, pp), a replica type (a layout on a fixed set of ranks)
and a candidate mix (how many replicas of each layout fill the world) are spelled once
here, frozen, so a plan, a process group and a cost-model entry name the same thing the
same way and no converter sits between them. The fixed sharding's bucket size is here
too: the cost model charges the buckets the runtime's sharding cuts, and the process groups a set
of replica types needs, counted per rank. Ranks inside a replica are in Megatron's
order: tp fastest, then cp, then pp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple


class Layout(NamedTuple):
    tp: int
    cp: int
    pp: int

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp

    def __str__(self) -> str:
        return f"tp{self.tp}cp{self.cp}pp{self.pp}"


def bucket_numel_for(num_params: int, requested: int = 0) -> int:
    """Elements per bucket of the runtime's fixed sharding: `requested` (--ddp-bucket-size)
    or Megatron's 40M for large models; mid-size models get 8 buckets (the exchange buffers
    are one bucket: a 100M model would otherwise hold 800 MB of them), models under 1M
    elements one (each bucket is a collective: latency on CPUs)."""
    if requested:
        return int(requested)
    return max(min(40_000_000, -(-num_params // 8)), min(num_params, 1_000_000), 1)


# a candidate: (layout, number of replicas) pairs whose devices add up to the world
LayoutMix = tuple[tuple[Layout, int], ...]


@dataclass(frozen=True)
class ReplicaType:
    """A layout placed on ranks: what a plan's replica runs on and a process group serves."""

    tp: int
    cp: int
    pp: int
    ranks: tuple[int, ...]
    stage_layers: tuple[int, ...] | None = None  # layers per pipeline stage; None = even split

    def __post_init__(self):
        if len(self.ranks) != self.tp * self.cp * self.pp:
            raise ValueError(f"replica {self}: {len(self.ranks)} ranks but tp*cp*pp = {self.tp * self.cp * self.pp}")
        if self.stage_layers is not None and len(self.stage_layers) != self.pp:
            raise ValueError(f"replica {self}: {len(self.stage_layers)} stage_layers for pp={self.pp}")

    @staticmethod
    def sort_key(r: "ReplicaType") -> tuple:
        """One order of replica types every process agrees on."""
        return (r.ranks, r.tp, r.cp, r.pp, r.stage_layers or ())

    def refactored(self, tp: int, cp: int) -> "ReplicaType":
        """The same ranks and stages with each stage's tp*cp ranks re-factored as (tp, cp)."""
        return ReplicaType(tp, cp, self.pp, self.ranks, self.stage_layers)

    def stage_range(self, pp_rank: int, num_layers: int) -> tuple[int, int]:
        """[first, end) global layers of pipeline stage `pp_rank`."""
        counts = self.stage_layers or (num_layers // self.pp,) * self.pp
        first = sum(counts[:pp_rank])
        return first, first + counts[pp_rank]

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.cp, self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, cp_rank, pp_rank) of a global rank inside this replica."""
        i = self.ranks.index(rank)
        return i % self.tp, (i // self.tp) % self.cp, i // (self.tp * self.cp)

    def rank_at(self, tp_rank: int, cp_rank: int, pp_rank: int) -> int:
        return self.ranks[tp_rank + self.tp * (cp_rank + self.cp * pp_rank)]

    def tp_ranks(self, cp_rank: int, pp_rank: int) -> tuple[int, ...]:
        return tuple(self.rank_at(t, cp_rank, pp_rank) for t in range(self.tp))

    def cp_ranks(self, tp_rank: int, pp_rank: int) -> tuple[int, ...]:
        return tuple(self.rank_at(tp_rank, c, pp_rank) for c in range(self.cp))

    def pp_ranks(self, tp_rank: int, cp_rank: int) -> tuple[int, ...]:
        return tuple(self.rank_at(tp_rank, cp_rank, p) for p in range(self.pp))

    def tp_cp_ranks(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(self.rank_at(t, c, pp_rank) for c in range(self.cp) for t in range(self.tp))

    def label(self) -> str:
        parts = [f"{name}{size}" for name, size in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp)) if size > 1]
        label = "·".join(parts) or "tp1"
        return label + ("[" + "-".join(map(str, self.stage_layers)) + "]" if self.stage_layers else "")


# ---------------------------------------------------------------- process groups
# The runtime creates every group its replica types use once, at start (dcp_ext.runtime.stages.groups);
# on NCCL each group of two or more ranks is a communicator with its own device buffers, which
# the planner charges (CostModel.charge_communicators) and scripts/scale_check.py counts.
def rank_sets(rep: ReplicaType) -> Iterator[tuple[int, ...]]:
    """Every rank set a replica's megatron-core groups use (tp, cp, tp-cp, pp, embedding,
    position embedding, model parallel, one-rank), in a deterministic order."""
    for p in range(rep.pp):
        for c in range(rep.cp):
            yield rep.tp_ranks(c, p)
        for t in range(rep.tp):
            yield rep.cp_ranks(t, p)
        yield rep.tp_cp_ranks(p)
    for c in range(rep.cp):
        for t in range(rep.tp):
            yield rep.pp_ranks(t, c)
            yield tuple(sorted({rep.rank_at(t, c, 0), rep.rank_at(t, c, rep.pp - 1)}))
            yield (rep.rank_at(t, c, 0),)
        yield tuple(rep.rank_at(tt, c, pp) for pp in range(rep.pp) for tt in range(rep.tp))
    for r in rep.ranks:
        yield (r,)


def distinct_groups(types: Iterable[ReplicaType]) -> list[tuple[int, ...]]:
    """The distinct rank sets of `types`, in creation order (sorted types, then `rank_sets`)."""
    seen: dict[tuple[int, ...], None] = {}
    for rep in sorted(set(types), key=ReplicaType.sort_key):
        for ranks in rank_sets(rep):
            seen.setdefault(tuple(sorted(ranks)), None)
    return list(seen)


def communicators_per_rank(types: Iterable[ReplicaType], world: int) -> list[int]:
    """For each rank, the groups of two or more ranks it belongs to: its communicators
    (a one-rank group moves no data and holds no transport buffers)."""
    counts = [0] * world
    for ranks in distinct_groups(types):
        if len(ranks) > 1:
            for r in ranks:
                counts[r] += 1
    return counts

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
from typing import Iterable, Iterator, NamedTuple, Sequence


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


# ---------------------------------------------------------------------------- mixes on the ranks
def place(layouts: Sequence[Layout], world: int) -> list[tuple[Layout, list[int]]]:
    """Contiguous, size-aligned rank blocks (largest replicas first), Megatron order inside
    each block (tp fastest, then cp, then pp). Deterministic."""
    order = sorted((Layout(*l) for l in layouts), key=lambda l: (-l.size, -l.tp, -l.cp, -l.pp))
    out, start = [], 0
    for lay in order:
        out.append((lay, list(range(start, start + lay.size))))
        start += lay.size
    if start != world:
        raise ValueError(f"layouts use {start} devices, the world has {world}")
    return out


def canonical(counts: dict[Layout, int]) -> LayoutMix:
    return tuple(sorted(((Layout(*k), v) for k, v in counts.items() if v > 0), key=lambda kv: (-kv[0].size, -kv[0].tp, -kv[0].cp, -kv[0].pp)))


def parse_layout(spec) -> LayoutMix:
    """"4xtp1cp1pp1", "1xtp2cp1pp1+2xtp1cp1pp1" or a list of (tp, cp, pp) replicas."""
    import re

    counts: dict[Layout, int] = {}
    if isinstance(spec, str):
        for part in spec.split("+"):
            m = re.fullmatch(r"\s*(?:(\d+)\s*x\s*)?tp(\d+)cp(\d+)pp(\d+)\s*", part)
            if not m:
                raise ValueError(f"layout {spec!r}: expected parts like 2xtp2cp1pp1")
            n = int(m.group(1) or 1)
            lay = Layout(int(m.group(2)), int(m.group(3)), int(m.group(4)))
            counts[lay] = counts.get(lay, 0) + n
    else:
        for t in spec:
            lay = Layout(*[int(v) for v in t])
            counts[lay] = counts.get(lay, 0) + 1
    return canonical(counts)


def expand(counts: Iterable[tuple[Layout, int]]) -> list[Layout]:
    return [lay for lay, n in counts for _ in range(n)]


def describe(counts: Iterable[tuple[Layout, int]]) -> str:
    return "+".join(f"{n}x{lay}" for lay, n in counts)


def mix_label(counts: Iterable[tuple[Layout, int]]) -> str:
    """`cp2 + 2×tp1`: a mix as the log line names an iteration's layout."""
    def one(lay: Layout) -> str:
        return "·".join(f"{k}{v}" for k, v in (("tp", lay.tp), ("cp", lay.cp), ("pp", lay.pp)) if v > 1) or "tp1"

    return " + ".join(f"{n}×{one(lay)}" if n > 1 else one(lay) for lay, n in counts)
